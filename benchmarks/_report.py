"""Shared output of the benchmarks: a markdown table on stdout, optionally appended to a file."""

from __future__ import annotations

import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_data(name: str = "mnist8k.npz") -> Path:
    """The project's offline data file ``name``: in ``../shared/data`` beside the checkout, or
    in ``shared/data`` inside it (where a copy travels with the checkout to a lent machine).
    The first of them when neither holds it (callers check ``exists()``)."""
    places = [ROOT.parent / "shared" / "data" / name, ROOT / "shared" / "data" / name]
    return next((p for p in places if p.exists()), places[0])


def machine() -> str:
    """The machine in a few words, with the instruction set torch's kernels use: the same
    model can need different memory on another ISA (oneDNN generates different kernels)."""
    text = f"{platform.machine()}, {os.cpu_count()} cores"
    try:
        import torch

        return f"{text}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    except (ImportError, AttributeError):
        return text


class Report:
    """Prints the header at once and each row as it is measured (long runs show progress)."""

    def __init__(self, header: str) -> None:
        self.header, self.rows = header, list[str]()
        print(header, flush=True)

    def row(self, text: str) -> None:
        self.rows.append(text)
        print(text, flush=True)

    def finish(self, summary: str, out: Path | None) -> None:
        print(summary)
        if out is not None:
            with out.open("a") as handle:
                handle.write("\n".join([self.header, *self.rows]) + "\n" + summary + "\n")
