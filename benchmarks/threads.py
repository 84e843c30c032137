"""How far intra-op threads carry one process's end-to-end training, against which a pipeline of
stages (one torch thread each) is measured: issue 18 asks the 2-stage pipeline for 1.15x the
rate of end-to-end training on two threads.

Each cell trains the whole model (forward, backward, SGD) on random inputs for ``--seconds`` in
a fresh process: one torch thread, then two with OpenMP's threads waiting passively (what
every edgesplit process sets) and actively (a one-process trainer that has the cores to
itself), the faster of the two kept. A 2-stage pipeline of equal stages runs at most twice one
thread's rate, so ``2 / (two threads' speed-up)`` is its ceiling against two threads, before
any transport cost.

    python benchmarks/threads.py [--models cnn:32,cnn:128,resnet8:32,mlp:64]
                                 [--seconds 4] [--out docs/benchmarks.md]

``--models``: ``model:batch`` pairs (cnn and mlp on 1x28x28, resnets on 3x32x32).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from _report import Report, machine

PIPELINE_GOAL = 1.15  # issue 18: a 2-stage pipeline against end-to-end on two threads


def _shape(model: str) -> tuple[int, ...]:
    return (3, 32, 32) if model.startswith("resnet") else (1, 28, 28)


def _rate(model: str, batch: int, threads: int, policy: str, seconds: float, out: Any) -> None:
    """Samples per second of whole-model training steps, in this fresh process."""
    os.environ["OMP_WAIT_POLICY"] = policy  # before torch loads OpenMP
    from split_models.runtime import configure_process

    configure_process(threads=threads)
    import torch

    from split_models.segment import OptimizerConfig, Segment
    from split_models.zoo import build_model

    built = build_model(model, _shape(model), 10, seed=0)
    whole = Segment.from_model(built, 0, built.num_blocks, optimizer=OptimizerConfig("sgd"))
    x, y = torch.randn(batch, *_shape(model)), torch.randint(0, 10, (batch,))
    for _ in range(5):  # the optimizer is built and the kernels made before the clock starts
        whole.train_step(x, y)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        whole.train_step(x, y)
        steps += 1
    out.put(steps * batch / (time.perf_counter() - started))


def _measure(model: str, batch: int, threads: int, policy: str, seconds: float) -> float:
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_rate, args=(model, batch, threads, policy, seconds, out))
    process.start()
    rate: float = out.get(timeout=600)
    process.join()
    return rate


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn:32,cnn:128,resnet8:32,mlp:64")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    report = Report(
        f"\n### Intra-op threads: end-to-end training on 1 and 2 torch threads ({machine()})\n\n"
        f"`python benchmarks/threads.py --models {args.models} --seconds {args.seconds:g}`: "
        "whole model, SGD, random inputs, one fresh process per cell.\n\n"
        "| model | batch | 1 thread, samples/s | 2 threads, passive | 2 threads, active "
        "| speed-up | a 2-stage pipeline's ceiling against 2 threads |\n"
        "|---|---|---|---|---|---|---|"
    )
    ceilings = []
    for pair in args.models.split(","):
        model, batch = pair.split(":")
        one = _measure(model, int(batch), 1, "PASSIVE", args.seconds)
        passive = _measure(model, int(batch), 2, "PASSIVE", args.seconds)
        active = _measure(model, int(batch), 2, "ACTIVE", args.seconds)
        speed_up = max(passive, active) / one
        ceilings.append(2 / speed_up)
        report.row(
            f"| {model} | {batch} | {one:.0f} | {passive:.0f} | {active:.0f} | "
            f"{speed_up:.2f}x | {2 / speed_up:.2f}x |"
        )
    reachable = sum(c >= PIPELINE_GOAL for c in ceilings)
    report.finish(
        f"\nA 2-stage pipeline at its ideal (twice one thread, no transport) would reach issue "
        f"18's {PIPELINE_GOAL}x against two threads for {reachable} of {len(ceilings)} "
        "models here.\n",
        args.out,
    )


if __name__ == "__main__":
    main()
