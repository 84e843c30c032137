"""One training step of a segment (`Segment.train_step`: forward, local head, backward, Adam),
with torch's per-tensor Adam loop against its fused kernel (the default since 2026-12-05).

Small client batches are where a step's fixed cost shows: a simulation of 1,000 clients
holding a few examples each runs one small step per client and round. Each cell is the median
of 7 timings of 10 steps, the two optimizers interleaved, one torch thread.

    python benchmarks/step.py [--segments cnn:2,cnn:5,resnet8:3] [--batches 6,32]
                              [--out docs/benchmarks.md]

``--segments``: ``model:end`` pairs (the first ``end`` blocks; cnn on 1x28x28, resnet8 on
3x32x32). The fused column per example tells a step's fixed cost from its per-example cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _report import Report, machine

from split_models.runtime import configure_process

configure_process()  # one torch thread, passive OpenMP waits: the CLI's settings

import torch  # noqa: E402

from split_models.config import ModelConfig  # noqa: E402
from split_models.segment import OptimizerConfig, Segment  # noqa: E402

SHAPES = {"cnn": (1, 28, 28), "resnet8": (3, 32, 32)}
SEGMENTS, BATCHES = "cnn:2,cnn:5,resnet8:3", "6,32"


def _segment(name: str, shape: tuple[int, ...], end: int, fused: bool) -> Segment:
    """The first ``end`` blocks of ``name`` with their head, Adam fused (the default) or the
    per-tensor loop over the same parameter groups."""
    model = ModelConfig(name=name, input_shape=shape, num_classes=10).build(seed=0)
    segment = Segment.from_model(model, 0, end, "linear", OptimizerConfig(name="adam", lr=1e-3))
    if not fused:
        groups = [
            {"params": g["params"], "lr_scale": g["lr_scale"]}
            for g in segment.optimizer.param_groups
        ]
        segment.optimizer = torch.optim.Adam(groups, lr=1e-3, foreach=False)
    assert bool(segment.optimizer.defaults["fused"]) == fused
    return segment


def _milliseconds(segment: Segment, x: torch.Tensor, y: torch.Tensor) -> float:
    began = time.perf_counter()
    for _ in range(10):
        segment.train_step(x, y)
    return (time.perf_counter() - began) / 10 * 1e3


def _segments(text: str) -> list[tuple[str, tuple[int, ...], int]]:
    cases = []
    for item in text.split(","):
        name, _, end = item.partition(":")
        if name not in SHAPES or not end.isdigit():
            raise SystemExit(f"--segments: expected model:end with a model of {sorted(SHAPES)}")
        cases.append((name, SHAPES[name], int(end)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", default=SEGMENTS, help="model:end pairs, comma-separated")
    parser.add_argument("--batches", default=BATCHES, help="batch sizes, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases, batches = _segments(args.segments), [int(b) for b in args.batches.split(",")]
    report = Report(
        f"### A segment's training step, Adam loop vs fused ({machine()})\n\n"
        f"`python benchmarks/step.py --segments {args.segments} --batches {args.batches}`\n\n"
        "| segment | batch | loop ms | fused ms | speed-up | fused ms an example |\n"
        "|---|---|---|---|---|---|"
    )
    for name, shape, end in cases:
        for batch in batches:
            loop, fused = _timings(name, shape, end, batch)
            report.row(
                f"| {name} [0, {end}) | {batch} | {loop:.2f} | {fused:.2f} | {loop / fused:.2f}x "
                f"| {fused / batch:.3f} |"
            )
    report.finish("", args.out)


def _timings(name: str, shape: tuple[int, ...], end: int, batch: int) -> tuple[float, float]:
    """Median step times (ms) with the Adam loop and fused."""
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    built = {fused: _segment(name, shape, end, fused) for fused in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for segment in built.values():  # warm-up: kernels set up per shape
        for _ in range(5):
            segment.train_step(x, y)
    for _ in range(7):
        for fused, segment in built.items():
            times[fused].append(_milliseconds(segment, x, y))
    return statistics.median(times[False]), statistics.median(times[True])


if __name__ == "__main__":
    main()
