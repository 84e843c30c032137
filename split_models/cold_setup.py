"""A block's cold kernel setup: what its first pass at the planned batch leaves resident in a
process that built the model, as a device does, and ran no other block's training pass.

The profiler measures blocks in order in one process, so a block's setup leaves out whatever
earlier blocks already set up: the code pages of ``libtorch_cpu.so`` that its kernels run at
that batch (a process's resident size counts the library pages it has touched) and the kernels
and caches generated for shapes met before. A segment that starts mid-model pays those again on
its device (a MobileNet-style squeeze-excite block: 2.1 MiB cold, 0.5 MiB after the blocks
before it). Each block is therefore also measured in a process of its own.

One spawned interpreter (the zygote) imports torch and builds the model, then forks a child
per distinct block, one at a time. A forked child shares its parent's pages, but the kernel
maps file-backed pages (the libraries' code) into a child lazily, so its first pass would count
every code page it runs as new, the import's too (4-6 MiB too much for MobileNet's blocks). The
zygote therefore lists the file pages it has resident (``/proc/self/pagemap``) and each child
reads a byte of each before it builds the model again and measures: the state of a freshly
spawned interpreter that built the model (measured against one per block: within 0.05 MiB on
each of MobileNetV3-small's 28 blocks), at a fork's cost rather than an interpreter's (28
blocks: 3.5 s against 24 s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["cold_setups"]

_TIMEOUT = 600.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cold_setups(model: str, keys: Sequence[str], batch: int | None) -> list[tuple[int, int]]:
    """For each block of ``model`` (a model section as JSON), the setup bytes of its first pass
    at ``batch`` without and with an input gradient (the second includes the first), each
    measured in a process of its own (see the module). Blocks with equal ``keys`` (same layers
    at the same shapes) are measured once. ``(0, 0)`` where a child could not measure: the
    estimate then uses the in-order setup."""
    first_of: dict[str, int] = {}
    for index, key in enumerate(keys):
        first_of.setdefault(key, index)
    found = _measure(model, sorted(set(first_of.values())), batch)
    return [found.get(first_of[key], (0, 0)) for key in keys]


def _measure(model: str, blocks: list[int], batch: int | None) -> dict[int, tuple[int, int]]:
    from split_models.measure import run_measuring_child

    arguments = ["split_models.cold_setup", "--model", model]
    arguments += ["--blocks", ",".join(map(str, blocks))]
    if batch is not None:
        arguments += ["--batch-size", str(batch)]
    try:
        done = run_measuring_child(arguments, _TIMEOUT)
        measured = json.loads(done.stdout) if done.returncode == 0 else {}
        return {int(block): (int(pair[0]), int(pair[1])) for block, pair in measured.items()}
    except (OSError, subprocess.TimeoutExpired, ValueError, TypeError, IndexError):
        return {}


def _resident_file_pages() -> list[int]:
    """The addresses of the readable file-backed pages this process has resident."""
    pages: list[int] = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or "r" not in fields[1]:
                continue
            start, end = (int(value, 16) for value in fields[0].split("-"))
            pagemap.seek(start // _PAGE * 8)
            entries = pagemap.read((end - start) // _PAGE * 8)
            pages += [
                start + index * _PAGE
                for index, (entry,) in enumerate(struct.iter_unpack("<Q", entries))
                if entry >> 63  # present
            ]
    return pages


def _in_child(
    build: Callable[[], Any], pages: list[int], block: int, batch: int | None
) -> tuple[int, int]:
    from split_models.profiler import first_pass_setups

    for address in pages:
        ctypes.string_at(address, 1)  # mapped here as in the zygote
    return first_pass_setups(build(), block, batch)


def _forked(
    build: Callable[[], Any], pages: list[int], block: int, batch: int | None
) -> tuple[int, int]:
    """Block ``block``'s setups, measured in a forked child; ``(0, 0)`` when it failed."""
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write, and leave without running the zygote's exits
        status = 1
        try:
            os.close(reading)
            os.write(writing, json.dumps(_in_child(build, pages, block, batch)).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not said:
        return 0, 0
    first, whole = json.loads(said)
    return int(first), int(whole)


def main(argv: list[str] | None = None) -> int:
    from split_models.runtime import configure_process

    configure_process()
    from split_models.config import ModelConfig, parse_config
    from split_models.measure import peak_supported

    parser = argparse.ArgumentParser(prog="python -m split_models.cold_setup")
    parser.add_argument("--model", required=True, help="the model section, as JSON")
    parser.add_argument("--blocks", required=True, help="block indices, comma-separated")
    parser.add_argument("--batch-size", type=int)
    args = parser.parse_args(argv)
    config = parse_config(ModelConfig, json.loads(args.model), "model")
    config.build(seed=0)  # imports and code pages a device's build has too
    blocks = [int(block) for block in args.blocks.split(",")]
    if not (peak_supported() and hasattr(os, "fork")):
        print(json.dumps({block: (0, 0) for block in blocks}))
        return 0
    pages = _resident_file_pages()

    def build() -> Any:
        return config.build(seed=0)

    print(json.dumps({block: _forked(build, pages, block, args.batch_size) for block in blocks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
