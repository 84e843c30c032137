"""Estimated vs measured training memory of zoo-model and gallery-model segments.

Each row trains one segment (with its local-loss head, or the task loss for the last segment)
for three steps in a fresh process and measures the real peak (VmHWM reset via
/proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=65536, minus the resident size before the segment
was built). Segments under 4 MiB are measured in three processes and the largest peak is kept:
at that size where the allocator places a few buffers moves a fresh process's peak by up to
0.15 MiB, and a device has to fit the largest. Targets: |error| <= 15% on every row
and no underestimate worse than -10%.

    python benchmarks/memory.py [--quick] [--gallery] [--only NAME] [--mode backprop]
                                [--out docs/benchmarks-memory.md]

``--gallery`` measures the ordinary ``nn.Module`` models split automatically
(``tests/fixtures/gallery.py``: torchvision's resnet18 and mobilenet_v3_small definitions,
the MobileNetV3-style network, the transformer encoder classifier) at batches 16 and 64
instead of the zoo.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _report import Report, machine

from split_models.runtime import configure_process

configure_process()

import torch  # noqa: E402

from split_models import ModelProfile, estimate_segment_memory, format_bytes  # noqa: E402
from split_models.config import ModelConfig, config_to_dict, parse_config  # noqa: E402
from split_models.isolated import profile_in_fresh_process  # noqa: E402
from split_models.measure import run_measuring_child  # noqa: E402

# model, input shape, segments (the cuts of a three-part split)
CASES = [
    ("mlp", (1, 28, 28), [(0, 1), (1, 2), (2, 4)]),
    ("cnn", (1, 28, 28), [(0, 2), (2, 4), (4, 6)]),
    ("cnn", (1, 8, 8), [(0, 2), (2, 6)]),
    ("resnet8", (3, 32, 32), [(0, 1), (1, 3), (3, 5)]),
    ("resnet20", (3, 32, 32), [(0, 4), (4, 8), (8, 11)]),
]
_TOKENS = {"input_dtype": "int64", "input_range": 64}
# import path, input shape, segments, input options
GALLERY = [
    ("tests.fixtures.gallery:resnet18", (3, 32, 32), [(0, 2), (2, 6), (6, 10)], {}),
    ("tests.fixtures.gallery:mobilenet_v3_small", (3, 32, 32), [(0, 8), (8, 18), (18, 28)], {}),
    ("tests.fixtures.gallery:mobilenet_like", (3, 32, 32), [(0, 3), (3, 6), (6, 9)], {}),
    ("tests.fixtures.gallery:transformer_classifier", (32,), [(0, 2), (2, 4)], _TOKENS),
]
BATCHES = (16, 64, 256)
GALLERY_BATCHES = (16, 64)
OPTIMIZER = "sgd-momentum"
SMALL_SEGMENT = 4 * 2**20


def _section(model: str, shape: tuple[int, ...], options: dict[str, object]) -> str:
    data = {"model": model, "input_shape": list(shape), "num_classes": 10, **options}
    return json.dumps(config_to_dict(parse_config(ModelConfig, data, "case")))


def measure(
    model: str,
    shape: tuple[int, ...],
    start: int,
    end: int,
    batch: int,
    optimizer: str,
    options: dict[str, object] | None = None,
    mode: str = "local-loss",
) -> dict[str, object]:
    done = run_measuring_child(
        [
            "split_models.measure",
            "--model",
            _section(model, shape, options or {}),
            "--start",
            str(start),
            "--end",
            str(end),
            "--batch-size",
            str(batch),
            "--optimizer",
            optimizer,
            f"--mode={mode}",
        ]
    )
    done.check_returncode()
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def fresh_profile(
    model: str, shape: tuple[int, ...], batch: int, options: dict[str, object] | None = None
) -> ModelProfile:
    """Profile in a new process, as the coordinator does (cold kernel setup per block
    included): kernels that an earlier profile in the same process generated would hide this
    model's one-time kernel setup."""
    section = json.loads(_section(model, shape, options or {}))
    return profile_in_fresh_process(parse_config(ModelConfig, section, "case"), ("linear",), batch)


def _largest_peak(run: tuple[Any, ...]) -> tuple[int, int]:
    """The measured peak of ``run`` (``measure``'s arguments) and the runtime's resident size;
    a segment under 4 MiB is measured three times, the largest kept (a device has to fit it)."""
    measured = [measure(*run)]
    if int(measured[0]["peak_bytes"]) < SMALL_SEGMENT:  # type: ignore[call-overload]
        measured += [measure(*run) for _ in range(2)]
    peak = max(int(m["peak_bytes"]) for m in measured)  # type: ignore[call-overload]
    return peak, int(measured[0]["runtime_bytes"])  # type: ignore[call-overload]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one segment per model, batch 64")
    parser.add_argument("--optimizer", default=OPTIMIZER)
    parser.add_argument(
        "--gallery", action="store_true", help="the automatically split gallery models"
    )
    parser.add_argument("--only", help="the cases whose model name contains this")
    parser.add_argument(
        "--mode",
        choices=("local-loss", "backprop"),
        default="local-loss",
        help="backprop: splitfed's segments before the last (no head; the next segment's "
        "gradient of the output arrives and is kept through backward)",
    )
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    torch.set_num_threads(1)
    header = (
        "| model | input | blocks | batch | estimate | measured | error | runtime |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    worst, worst_under = 0.0, 0.0
    report = Report(header)
    cases = GALLERY if args.gallery else [(*case, {}) for case in CASES]
    batches = GALLERY_BATCHES if args.gallery else BATCHES
    cases = [case for case in cases if args.only is None or args.only in case[0]]
    for name, shape, segments, options in cases:
        for batch in (64,) if args.quick else batches:
            profile = fresh_profile(name, shape, batch, options)
            if args.mode == "backprop":  # the last segment has the task loss in both modes
                segments = [(s, e) for s, e in segments if e < profile.num_blocks]
            head = None if args.mode == "backprop" else "linear"
            for start, end in segments[:1] if args.quick else segments:
                estimate = estimate_segment_memory(profile, start, end, batch, args.optimizer, head)
                run = (name, shape, start, end, batch, args.optimizer, options, args.mode)
                peak, runtime = _largest_peak(run)
                error = (estimate.total - peak) / peak
                worst, worst_under = max(worst, abs(error)), min(worst_under, error)
                report.row(
                    f"| {name.rpartition(':')[2]} | {'x'.join(map(str, shape))} "
                    f"| [{start}, {end}) | {batch} "
                    f"| {format_bytes(estimate.total)} | {format_bytes(peak)} "
                    f"| {error:+.1%} | {format_bytes(runtime)} |"
                )
    verdict = "PASS" if worst <= 0.15 and worst_under >= -0.10 else "FAIL"
    summary = (
        f"\nworst |error| {worst:.1%}, worst underestimate {worst_under:+.1%} "
        f"(targets 15% / -10%): {verdict}; optimizer {args.optimizer}, {args.mode}; "
        f"{machine()}, torch {torch.__version__}"
    )
    report.finish(summary, args.out)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
