"""The peak meter reads a region touched and unmapped at its size, whatever the kernel's
per-CPU page counters held unfolded when the meter started.

Each check runs in a fresh single-threaded process, as real measurements do: threads left over
from other tests fault and fold pages on other CPUs while the meter runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from split_models.measure import peak_supported

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not peak_supported(), reason="needs /proc/self/clear_refs (Linux)"),
]

_CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys
    from split_models.measure import PeakMeter, counter_lag

    PAGE = mmap.PAGESIZE
    held_open = sys.argv[1] == "held"
    unfolded, sizes = int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU: one per-CPU counter
    # Fault pages and keep them mapped: up to 31 of them stay in the per-CPU counter, not in
    # the total the kernel raises the high-water mark from.
    held = mmap.mmap(-1, (64 + unfolded) * PAGE)
    for index in range(64 + unfolded):
        held[index * PAGE] = 1
    errors = []
    for pages in sizes:
        meter = PeakMeter().start()
        region = mmap.mmap(-1, pages * PAGE)
        for index in range(pages):
            region[index * PAGE] = 1
        if not held_open:
            region.close()  # the unmap records the peak in the kernel's folded count
        errors.append((meter.peak() - pages * PAGE) / PAGE)
        meter.close()
        region.close()
    print(json.dumps({"errors": errors, "lag": counter_lag()}))
    """
)


def _run_child(code: str, *arguments: object, mmap_threshold: int = 65536) -> dict[str, Any]:
    """Run ``code`` in a fresh Python process and return the JSON object it prints. torch is
    loaded first, as in every process that measures (without it, readings came 1-3 pages
    shorter still: a lighter interpreter, other counts left unfolded)."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch\n" + code, *map(str, arguments)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)},
    )
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _errors_in_pages(unfolded: int, sizes: list[int], held: bool = False) -> dict[str, Any]:
    return _run_child(_CHILD, "held" if held else "unmapped", unfolded, *sizes)


# Pages an unmapped region's reading may come short beyond the rule. On one machine (a VM
# whose host runs DAMON proactive reclaim, 2026-12-07) every fresh process read 8-12 pages
# short from mid-session on, old code and new alike, where the same tests had read within 2
# pages an hour before; mlockall did not change it and the cause was not found. Each test
# below still fails on what it guards against: 18-93 pages short (measured), or the 24 hidden.
_DRIFT = 12


@pytest.mark.parametrize("unfolded", [0, 7, 19, 30])
def test_a_region_of_whole_fold_batches_reads_at_its_size(unfolded: int) -> None:
    # A meter that takes the exact resident size as its baseline under-reads by what is left
    # unfolded: by 18-93 pages in fresh processes on a 2-CPU machine (measured).
    errors = _errors_in_pages(unfolded, [320, 704, 1024])["errors"]  # whole 32-page batches
    assert all(-2 - _DRIFT <= error <= 2 for error in errors), errors


def test_a_region_reads_short_only_by_what_is_left_of_its_last_fold_batch() -> None:
    sizes = [300, 555, 700]
    errors = _errors_in_pages(11, sizes)["errors"]
    for pages, error in zip(sizes, errors, strict=True):
        assert -(pages % 32) - 2 - _DRIFT <= error <= 2, (pages, errors)


@pytest.mark.parametrize("unfolded", [0, 19])
def test_a_region_still_mapped_reads_at_its_size(unfolded: int) -> None:
    # With nothing unmapped since the start, VmHWM shows the exact resident size, not the
    # folded count: a meter that took the folded count as its only baseline over-read by the
    # whole lag here (52-85 pages in fresh processes on a 2-CPU machine, measured).
    errors = _errors_in_pages(unfolded, [10, 300, 704], held=True)["errors"]
    assert all(abs(error) <= 2 for error in errors), errors


def test_the_lag_is_within_what_the_kernel_can_hold_unfolded() -> None:
    cpus = os.cpu_count() or 1
    bound = 3 * max(32, 2 * cpus) * cpus * 4096  # three counters, one batch per CPU each
    lag = _errors_in_pages(5, [64])["lag"]
    assert -bound <= lag <= bound


_HIDDEN_CHILD = textwrap.dedent(
    """
    import json, mmap, os
    from split_models.measure import PeakMeter, counter_lag

    PAGE = mmap.PAGESIZE
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with PeakMeter() as meter:
        kept = mmap.mmap(-1, 296 * PAGE)  # stays, like a step's weights and gradients
        freed = mmap.mmap(-1, 24 * PAGE)  # goes again, like its temporaries
        for region, pages in ((kept, 296), (freed, 24)):
            for index in range(pages):
                region[index * PAGE] = 1
        freed.close()
        error = (meter.peak() - 320 * PAGE) / PAGE
    print(json.dumps({"error": error, "lag": meter.lag / PAGE}))
    """
)


def test_a_peak_freed_by_less_than_the_lag_is_not_hidden() -> None:
    # After the peak only 24 pages go, so the exact size now (296 pages up) stays above the
    # mark the unmap raised from the folded count whenever that count lags by more than 24
    # pages (it lagged by 9-93 in fresh processes): a meter without its ballast read 296.
    result = _run_child(_HIDDEN_CHILD)
    assert -2 - _DRIFT <= result["error"] <= 2, result


_HOLE_CHILD = textwrap.dedent(
    """
    import ctypes, ctypes.util, json
    from split_models.measure import resident_bytes, trim_heap

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    blocks = [libc.malloc(16384) for _ in range(257)]
    for block in blocks:
        ctypes.memset(block, 1, 16384)
    for block in blocks[:-1]:  # a hole of 4 MiB below the last block, which pins the top
        libc.free(ctypes.c_void_p(block))
    before = resident_bytes()
    trimmed = trim_heap()
    print(json.dumps({"released": before - resident_bytes(), "trimmed": trimmed}))
    """
)


def test_trim_heap_releases_a_hole_below_the_top_of_the_heap() -> None:
    # Free pages in the middle of the heap stay resident (the top cannot shrink past a live
    # block); a measured step could reuse them and read low. The meter trims them at its start.
    result = _run_child(_HOLE_CHILD, mmap_threshold=1 << 20)
    assert result["trimmed"]
    assert result["released"] >= 3 * 2**20, result


def test_a_meter_started_beside_another_one_is_not_read_short_when_that_one_goes() -> None:
    # The other meter's ballast would go after this one's baseline (when it is dropped), and
    # this one would read it short: starting a meter closes the other's ballast first.
    child = textwrap.dedent(
        """
        import json, mmap, os
        from split_models.measure import PeakMeter

        PAGE = mmap.PAGESIZE
        # One CPU, as in the checks above: moved to another CPU between the start and the
        # reading, the kernel's unfolded count changes under the meter (read -33 pages once,
        # on a CI run with two busy test workers).
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        old = PeakMeter().start()
        meter = PeakMeter().start()
        del old
        region = mmap.mmap(-1, 320 * PAGE)
        for index in range(320):
            region[index * PAGE] = 1
        region.close()
        print(json.dumps({"error": (meter.peak() - 320 * PAGE) / PAGE}))
        """
    )
    result = _run_child(child)
    assert -2 - _DRIFT <= result["error"] <= 2, result


@pytest.mark.parametrize("mode", ["backprop", "local-loss"])
def test_the_warm_up_trains_on_the_path_it_measures(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warmed up on the local loss's path, a splitfed front's measurement counted the lazy
    set-up of its own backward as training (1.1 MiB of the cnn's 19.3 MiB at batch 32)."""
    import argparse

    from split_models import measure
    from split_models.config import ModelConfig
    from split_models.segment import Segment

    taken: list[str] = []
    for name in ("train_step", "backward_from"):
        original = getattr(Segment, name)

        def counted(self: Segment, *args: object, _o: object = original, _n: str = name) -> object:
            taken.append(_n)
            return _o(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(Segment, name, counted)
    args = argparse.Namespace(
        start=0, end=2, local_loss="linear", optimizer="adam", proximal_mu=0.0, mode=mode
    )
    measure._warm_up(ModelConfig("cnn", (1, 8, 8), 10), args)
    expected = "backward_from" if mode == "backprop" else "train_step"
    assert taken == [expected] * 3, taken
