"""A block's cold kernel setup: what its first pass at the planned batch leaves resident in a
process that built the model, as a device does, and ran no other block's training pass.

The profiler measures blocks in order in one process, so a block's setup leaves out whatever
earlier blocks already set up: the code pages of ``libtorch_cpu.so`` that its kernels run at
that batch (a process's resident size counts the library pages it has touched) and the kernels
and caches generated for shapes met before. A segment that starts mid-model pays those again on
its device (a MobileNet-style squeeze-excite block: 2.1 MiB cold, 0.5 MiB after the blocks
before it). Each block is therefore also measured in a fresh process of its own, a spawned
interpreter (a forked child would share its parent's pages and re-fault the library's code).
The child builds the whole model first: building runs code that a bare block's first pass
would otherwise fault in (an unpickled squeeze-excite block read 8.3 MiB of code pages).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["cold_setups"]

_TIMEOUT = 300.0


def _start(model: str, block: int, batch: int | None) -> subprocess.Popen[str] | None:
    from split_models.measure import measure_child_env

    arguments = ["--model", model, "--block", str(block)]
    if batch is not None:
        arguments += ["--batch-size", str(batch)]
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "split_models.cold_setup", *arguments],
            env=measure_child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None


def _finish(child: subprocess.Popen[str] | None) -> tuple[int, int]:
    if child is None:
        return 0, 0
    try:
        out, _ = child.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return 0, 0
    if child.returncode != 0:
        return 0, 0
    first, whole = json.loads(out)
    return int(first), int(whole)


def cold_setups(
    model: str, keys: Sequence[str], batch: int | None, workers: int | None = None
) -> list[tuple[int, int]]:
    """For each block of ``model`` (a model section as JSON), the setup bytes of its first pass
    at ``batch`` without and with an input gradient (the second includes the first), each
    measured in a fresh process. Blocks with equal ``keys`` (same layers at the same shapes)
    are measured once. ``(0, 0)`` where a child could not measure: the estimate then uses the
    in-order setup."""
    workers = workers or max(1, min(2, len(os.sched_getaffinity(0))))
    first_of: dict[str, int] = {}
    for index, key in enumerate(keys):
        first_of.setdefault(key, index)
    blocks, found = list(first_of.values()), dict[int, tuple[int, int]]()
    for offset in range(0, len(blocks), workers):
        wave = blocks[offset : offset + workers]
        children = [_start(model, block, batch) for block in wave]
        for block, child in zip(wave, children, strict=True):
            found[block] = _finish(child)
    return [found[first_of[key]] for key in keys]


def main(argv: list[str] | None = None) -> int:
    from split_models.runtime import configure_process

    configure_process()
    from split_models.config import ModelConfig, parse_config
    from split_models.profiler import first_pass_setups

    parser = argparse.ArgumentParser(prog="python -m split_models.cold_setup")
    parser.add_argument("--model", required=True, help="the model section, as JSON")
    parser.add_argument("--block", type=int, required=True)
    parser.add_argument("--batch-size", type=int)
    args = parser.parse_args(argv)
    model = parse_config(ModelConfig, json.loads(args.model), "model").build(seed=0)
    print(json.dumps(first_pass_setups(model, args.block, args.batch_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
