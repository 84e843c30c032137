"""A GPU host's first check, before benchmarks/gpu.sh times anything: short simulations with
the GPU server's back (``gpu.device``) and, stacked, the clients' segments
(``client_device``) on ``--device``, in each split mode, against the same runs on the CPU.

scikit-learn's digits, the ``cnn``, 4 clients of two device profiles (two cuts), Adam 2e-3,
2 rounds. A row fails when its accuracy is not finite or not above chance (0.1); the GPU and
CPU rows of one mode agree only up to the order of floating-point sums, so they are printed
side by side, not compared exactly. Exits 1 when any row fails.

    python benchmarks/gpu_smoke.py [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from split_models.runtime import configure_process

configure_process()

import torch  # noqa: E402

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulation.config import parse_sim_config  # noqa: E402
from simulation.simulator import simulate  # noqa: E402


def _run(method: str, batched: bool, device: str, out: Path) -> tuple[list[float], float]:
    config = parse_sim_config(
        {
            "method": method,
            "clients": 4,
            "devices": [
                {"profile": "small", "share": 0.5, "memory": "4MiB", "flops": 2e9},
                {"profile": "large", "share": 0.5, "memory": "64MiB", "flops": 5e10},
            ],
            "rounds": 2,
            "batched": batched,
            "client_device": device if batched else "cpu",
            "gpu": {"device": device},
            "measure_memory": False,
        }
    )
    started = time.perf_counter()
    summary = simulate(config, out)
    accuracies = [float(r["accuracy"]) for r in summary["rounds"]]
    return accuracies, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    failed = 0
    print("| method | client steps | device | accuracy by round | s |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for method in ("local-loss", "splitfed"):
            for batched in (False, True):
                for device in ("cpu", args.device):
                    where = f"{device}-{method}-{batched}"
                    accuracies, seconds = _run(method, batched, device, Path(scratch) / where)
                    bad = not accuracies or not all(
                        math.isfinite(a) and a > 0.1 for a in accuracies
                    )
                    failed += bad
                    print(
                        f"| {method} | {'stacked' if batched else 'one by one'} | {device} | "
                        f"{', '.join(f'{a:.4f}' for a in accuracies)}{' FAILED' if bad else ''} "
                        f"| {seconds:.1f} |",
                        flush=True,
                    )
    if torch.cuda.is_available():
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
