"""Measured peak memory of this process, for checking estimates and reporting real usage.

Linux only: the high-water mark ``VmHWM`` of ``/proc/self/status`` is reset to the current
resident size by writing ``5`` to ``/proc/self/clear_refs``. Run with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors go back to the kernel and the mark follows
tensor lifetimes (``tracemalloc`` sees nothing of torch's allocations).

The kernel keeps a process's resident pages in per-CPU counters that it folds into a total in
batches of 32 pages. ``VmRSS`` is the exact sum, but the high-water mark is raised (at every unmap)
and reset (by ``clear_refs``) from the folded total alone, and ``VmHWM`` shows the larger of that
mark and the exact ``VmRSS`` now. The two counts differ by what is unfolded: 18-93 pages (72-372
KiB) in fresh processes on Linux 6.18 with 2 CPUs, a different amount in every process and the
same through one process (unmapping regions on every CPU did not fold it away). A meter that
takes the exact size as its baseline under-reads every peak an unmap recorded by that much; one
that takes the folded total over-reads by as much every peak still resident when it is read (a
small block's training pass read 28, 104 and 164 KiB in three processes). :class:`PeakMeter`
measures the lag when it starts (:func:`counter_lag`: touch and unmap a region of known size),
takes each reading against the baseline of the count it came from, and keeps a mark hidden below
the exact size from being lost (see the class). What is left is the part of the last 32-page
batch not yet folded at the peak: a region of N pages reads N - N mod 32 pages when an unmap
recorded its peak and N while it is still mapped (test ``tests/unit/test_peak_meter.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import json
import mmap
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from split_models.config import ModelConfig
    from split_models.segment import Segment

__all__ = [
    "MEASURE_ENV",
    "PeakMeter",
    "counter_lag",
    "measure_child_env",
    "measure_in_fresh_process",
    "peak_supported",
    "release_freed_memory",
    "resident_bytes",
    "run_measuring_child",
]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# The allocator settings of every memory measurement: tensors of 64 KiB and more are mapped and
# unmapped one by one, and the heap gives freed memory back at once (no trim threshold, no top
# pad), so the resident size follows what is alive; with glibc's defaults a small segment's peak
# read anywhere in 700-1050 KiB from run to run, with these 910-1020 KiB.
MEASURE_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_TOP_PAD_": "0",
}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory(threshold: int = 65536) -> bool:
    """Make glibc serve allocations above ``threshold`` bytes with mmap and trim its heap at
    every free, as :data:`MEASURE_ENV` does, so freed memory leaves the resident set at once."""
    libc = _libc()
    settings = ((_M_MMAP_THRESHOLD, threshold), (_M_TRIM_THRESHOLD, 0), (_M_TOP_PAD, 0))
    try:
        return libc is not None and all(libc.mallopt(option, value) for option, value in settings)
    except AttributeError:  # not glibc
        return False


def trim_heap() -> bool:
    """Give the heap's free pages back to the kernel, wherever they are in it (glibc's
    ``malloc_trim``), so that what a measured step allocates is counted as the pages it needs,
    not hidden in holes that earlier work left resident; whether it could."""
    libc = _libc()
    try:
        return libc is not None and libc.malloc_trim(0) >= 0
    except AttributeError:  # not glibc
        return False


def _status_fields(*fields: str) -> tuple[int, ...]:
    """Fields of ``/proc/self/status`` in bytes, from one reading of it."""
    found = {}
    for line in _STATUS.read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            found[name] = int(value.split()[0]) * 1024
    missing = [f for f in fields if f not in found]
    if missing:
        raise OSError(f"{', '.join(missing)} not found in {_STATUS}")
    return tuple(found[f] for f in fields)


def _status_bytes(field: str) -> int:
    return _status_fields(field)[0]


def resident_bytes() -> int:
    """Current resident set size of this process in bytes."""
    return _status_bytes("VmRSS")


def _clear_peak() -> None:
    with _CLEAR_REFS.open("w") as handle:
        handle.write("5")


def peak_supported() -> bool:
    """Whether the high-water mark of this process can be reset (Linux with clear_refs)."""
    try:
        _clear_peak()
        return True
    except OSError:
        return False


_FOLD_BATCH = max(32, 2 * (os.cpu_count() or 1))  # the kernel's percpu_counter_batch


def _probe_pages() -> int:
    """Pages for the lag probe: a whole number of fold batches, more than the kernel can hold
    unfolded (a batch per CPU for each of three counters) on this machine."""
    return _FOLD_BATCH * min(max(16, 4 * (os.cpu_count() or 1)), 4096 // _FOLD_BATCH)


def _touched(pages: int) -> mmap.mmap:
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    for index in range(pages):
        region[index * mmap.PAGESIZE] = 1
    return region


def _touch_and_unmap(pages: int) -> None:
    _touched(pages).close()


def counter_lag() -> int:
    """Bytes by which the kernel's high-water mark under-reads the exact resident size now
    (negative where it over-reads): touch a region of known size, unmap it (which raises the
    mark from the kernel's approximate count) and compare. Resets the high-water mark."""
    # Unmapping a region folds this CPU's counter; the first region does that, so the second
    # (a whole number of batches) measures the lag that stays: other CPUs' and other counters'.
    _touch_and_unmap(2 * _FOLD_BATCH)
    pages = _probe_pages()
    _clear_peak()
    exact = resident_bytes()
    _touch_and_unmap(pages)
    return exact + pages * mmap.PAGESIZE - _status_bytes("VmHWM")


@dataclass(eq=False)  # a meter is a thing with a lifetime, equal only to itself
class PeakMeter:
    """Measures the peak resident bytes above the level at ``start()``.

    ``baseline`` is the exact resident size at the start (lower it to count memory that exists
    before the start as part of the peak); ``lag`` is what the kernel's folded count was behind
    it then.

    A mark the kernel raised from its folded count is hidden while the exact size now is above
    it: a step whose memory stays resident (weights, gradients, optimizer state) hides the part
    of its peak that was freed again whenever that part is smaller than the lag (a segment that
    peaked 230 KiB above what it kept read 1.6 instead of 1.8 MiB, with a lag of 240-264 KiB).
    So the meter holds a ballast region, larger than the lag, from before its baseline; a
    reading unmaps it, which raises the mark from the folded count now and lowers the exact
    size below the mark, then maps it again. :meth:`close` (or leaving a ``with`` block) unmaps
    it for good. Starting a meter closes the ballast of any other (which then reads as a meter
    without one): a ballast that went after this meter's baseline would make it read short.
    """

    baseline: int = 0
    lag: int = 0
    _ballast: mmap.mmap | None = field(default=None, repr=False)
    _with_ballast: ClassVar[weakref.WeakSet[PeakMeter]] = weakref.WeakSet()

    def start(self) -> PeakMeter:
        for other in list(PeakMeter._with_ballast):
            other.close()
        trim_heap()
        self.lag = counter_lag()
        self._ballast = _touched(self._ballast_pages())
        PeakMeter._with_ballast.add(self)
        self.baseline = resident_bytes()
        _clear_peak()
        return self

    def close(self) -> None:
        """Unmap the ballast; the meter reads nothing after this."""
        if self._ballast is not None:
            self._ballast.close()
            self._ballast = None
        PeakMeter._with_ballast.discard(self)

    def __enter__(self) -> PeakMeter:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _ballast_pages(self) -> int:
        # Whole fold batches (the unmap then leaves this CPU's count as it was), above the lag
        # by what a step can leave unfolded on the CPUs it runs on (three counters each).
        batch_bytes = _FOLD_BATCH * mmap.PAGESIZE
        cpus = min(len(os.sched_getaffinity(0)), 4)
        return _FOLD_BATCH * (-(-max(0, self.lag) // batch_bytes) + 3 * cpus)

    def peak(self) -> int:
        """Peak resident bytes since ``start()``, minus the baseline at ``start()``."""
        ballast = 0
        if self._ballast is not None:
            ballast = len(self._ballast)
            self._ballast.close()
        mark, resident = _status_fields("VmHWM", "VmRSS")
        if ballast:
            self._ballast = _touched(ballast // mmap.PAGESIZE)
        now = resident + ballast - self.baseline
        if mark > resident:  # the mark, raised from the folded count
            return max(0, now, mark - (self.baseline - self.lag))
        return max(0, now)  # no ballast (closed, never started): a lower mark is unseen


def _warm_up(spec: ModelConfig, args: argparse.Namespace) -> None:
    """Train a throw-away copy of the same segment (same layers, head and optimizer, tiny
    batch) so code that torch loads lazily counts as runtime, not training."""
    import torch

    from split_models.segment import OptimizerConfig, Segment

    warm = spec.build(seed=1)
    with torch.no_grad():
        warm_inputs = warm.segment(0, args.start)(warm.example_input(2)) if args.start else None
    warm_segment = Segment.from_model(
        warm, args.start, args.end, args.local_loss, OptimizerConfig(args.optimizer)
    )
    if args.proximal_mu > 0:
        warm_segment.reset_optimizer(args.proximal_mu)
    for _ in range(3):  # the second optimizer step initialises more of the runtime lazily
        inputs = warm_inputs if warm_inputs is not None else warm.example_input(2)
        labels = torch.zeros(2, *warm.label_shape, dtype=torch.long)
        _step(warm_segment, inputs, labels, args.mode)  # the path measured: its lazy set-up


def _step(segment: Segment, inputs: torch.Tensor, labels: torch.Tensor, mode: str) -> None:
    """One training step of ``segment`` as a round takes it in ``mode``: in backprop the
    gradient of its output arrives from the next segment (a backward set up lazily on its
    own: warmed up on the local loss's path, 1.0 MiB of it was counted as training)."""
    import torch

    from split_models.activations import primary

    if mode == "backprop":
        output = segment.forward_for_backprop(inputs)
        activation = primary(output)
        segment.backward_from(output, torch.ones_like(activation) / activation.numel())
    else:
        segment.train_step(inputs, labels)


def _measure(args: argparse.Namespace) -> dict[str, object]:
    import torch

    torch.set_num_threads(1)
    from split_models.activations import nbytes
    from split_models.config import ModelConfig, parse_config
    from split_models.segment import OptimizerConfig, Segment

    spec = parse_config(ModelConfig, json.loads(args.model), "model")
    _warm_up(spec, args)
    gc.collect()
    runtime = resident_bytes()

    model = spec.build(seed=0)
    generator = torch.Generator().manual_seed(0)
    inputs = model.example_input(args.batch_size, generator)
    if args.start > 0:
        with torch.no_grad():
            inputs = model.segment(0, args.start)(inputs)
    labels = torch.randint(
        0, spec.num_classes, (args.batch_size, *model.label_shape), generator=generator
    )
    segment = Segment.from_model(
        model, args.start, args.end, args.local_loss, OptimizerConfig(args.optimizer)
    )
    del model
    if args.proximal_mu > 0:  # FedProx: the round's weights, kept as the proximal anchor
        segment.reset_optimizer(args.proximal_mu)
    gc.collect()
    # The segment's weights (and FedProx's anchor) and its input batch exist before the meter
    # starts; count them as part of the peak, as the estimate does, by lowering the baseline
    # by their size.
    resident = sum(t.numel() * t.element_size() for t in segment.state_tensors())
    if args.proximal_mu > 0:
        resident += sum(p.numel() * p.element_size() for p in segment.trainable_parameters())
    resident += nbytes(inputs) + labels.numel() * labels.element_size()
    peaks = []
    with PeakMeter() as meter:
        meter.baseline -= resident
        for _ in range(args.steps):
            _step(segment, inputs, labels, args.mode)
            peaks.append(meter.peak())
    return {"runtime_bytes": runtime, "peak_bytes": max(peaks), "step_peaks": peaks}


def measure_child_env() -> dict[str, str]:
    """The environment of a child process that measures memory: this one's, with edgesplit's
    runtime settings, :data:`MEASURE_ENV` and this process's import path."""
    from split_models.runtime import RUNTIME_ENV

    path = os.pathsep.join(p for p in (os.getcwd(), *sys.path) if p)
    return {**os.environ, **RUNTIME_ENV, **MEASURE_ENV, "PYTHONPATH": path}


def run_measuring_child(
    arguments: list[str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ARGUMENTS`` in a child process with :func:`measure_child_env`, its
    output captured as text; the caller judges the exit code (``TimeoutExpired`` passes)."""
    return subprocess.run(
        [sys.executable, "-m", *arguments],
        env=measure_child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def measure_in_fresh_process(
    model: ModelConfig,
    start: int,
    end: int,
    batch_size: int,
    optimizer: str,
    local_loss: str = "linear",
    mode: str = "local-loss",
    timeout: float = 300.0,
) -> int | None:
    """The measured peak bytes of training blocks ``[start, end)`` for a few steps, in a child
    process started for it (a long-running process's heap hides part of the peak); ``None``
    where the peak cannot be measured (not Linux) or the child failed."""
    from split_models.config import config_to_dict

    if not peak_supported():
        return None
    arguments = [
        "split_models.measure",
        "--model=" + json.dumps(config_to_dict(model)),
        f"--start={start}",
        f"--end={end}",
        f"--batch-size={batch_size}",
        f"--optimizer={optimizer}",
        f"--local-loss={local_loss}",
        f"--mode={mode}",
    ]
    try:
        done = run_measuring_child(arguments, timeout)
        return int(json.loads(done.stdout)["peak_bytes"]) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, KeyError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Train one segment for a few steps in this process and print its peak as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="the model section, as JSON")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--optimizer", default="sgd-momentum")
    parser.add_argument("--local-loss", default="linear")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", choices=("local-loss", "backprop"), default="local-loss")
    parser.add_argument("--proximal-mu", type=float, default=0.0, help="FedProx's, > 0: anchored")
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        print("warning: MALLOC_MMAP_THRESHOLD_ is not set; peaks will be noisy", file=sys.stderr)
    print(json.dumps(_measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
