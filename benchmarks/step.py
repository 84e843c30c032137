"""One training step of a segment (`Segment.train_step`: forward, local head, backward, Adam),
with torch's per-tensor Adam loop against its fused kernel (the default since 2026-12-05).

Small client batches are where a step's fixed cost shows: a simulation of 1,000 clients
holding a few examples each runs one small step per client and round. Each cell is the median
of 7 timings of 10 steps, the two optimizers interleaved, one torch thread.

    python benchmarks/step.py [--out docs/benchmarks.md]
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

CASES = [("cnn", (1, 28, 28), 2), ("cnn", (1, 28, 28), 5), ("resnet8", (3, 32, 32), 3)]
BATCHES = (6, 32)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = Report(
        f"### A segment's training step, Adam loop vs fused ({machine()})\n\n"
        "`python benchmarks/step.py`\n\n"
        "| segment | batch | loop ms | fused ms | speed-up |\n|---|---|---|---|---|"
    )
    for name, shape, end in CASES:
        for batch in BATCHES:
            x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
            built = {fused: _segment(name, shape, end, fused) for fused in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            for segment in built.values():  # warm-up: kernels set up per shape
                for _ in range(5):
                    segment.train_step(x, y)
            for _ in range(7):
                for fused, segment in built.items():
                    times[fused].append(_milliseconds(segment, x, y))
            loop, fused = statistics.median(times[False]), statistics.median(times[True])
            report.row(
                f"| {name} [0, {end}) | {batch} | {loop:.2f} | {fused:.2f} | {loop / fused:.2f}x |"
            )
    report.finish("", args.out)


if __name__ == "__main__":
    main()
