"""Write the compose deployment's data: each edge's share and a held-out test set, as npz.

    python deploy/compose/make_data.py [--source npz:PATH | digits]

Defaults to ../shared/data/mnist8k.npz when present, else scikit-learn's bundled digits
(resized to 28x28 by nearest-neighbour repetition so the run config's input shape holds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data" / "mnist8k.npz"
EDGES = ("pi-01", "pi-02", "pi-03")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", default=f"npz:{SHARED}" if SHARED.exists() else "digits")
    parser.add_argument("--out", type=Path, default=HERE / "data")
    args = parser.parse_args(argv)
    if args.source == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = (bunch.images / 16.0 * 255).astype(np.uint8)
        x = images.repeat(4, axis=1).repeat(4, axis=2)[:, 2:30, 2:30]
        y = bunch.target.astype(np.uint8)
    else:
        with np.load(args.source.removeprefix("npz:")) as archive:
            x, y = archive["x"], archive["y"]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    test = len(x) // 5
    np.savez(out / "test.npz", x=x[-test:], y=y[-test:])
    for index, name in enumerate(EDGES):
        rows = np.arange(index, len(x) - test, len(EDGES))
        np.savez(out / f"{name}.npz", x=x[rows], y=y[rows])
    print(f"wrote {out}/test.npz and {len(EDGES)} edge files from {args.source}")


if __name__ == "__main__":
    main()
