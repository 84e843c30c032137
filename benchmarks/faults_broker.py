"""What a broker restart costs a real deployment (issue 17): a coordinator, one GPU server and
three edges, each its own process, on a private mosquitto configured as the shipped one
(persistence on, its autosave interval). Once round 1's activations flow, the broker is stopped
(SIGTERM: it saves and publishes every will; SIGKILL: it loses what arrived since its last
save), stays down 2 s or 30 s, and starts again on the same port.

Columns: whether the run finished, the rounds' tries redone (a committed try after the first),
the seconds the run took beyond the same run without a fault, and the activation batches lost
or trained twice in the committed tries (from the edges' ``batches-sent`` and the server's
``batches-trained`` log lines, docs/wire.md "Counting").

    python benchmarks/faults_broker.py [--quick]     (--quick: the 2 s outages only)

``benchmarks/faults.py`` imports :func:`rows` for its table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.deployment import EDGES, Deployment, opened  # noqa: E402
from tests.faults.broker_run import (  # noqa: E402
    PER_EDGE,
    Streaming,
    count_batches,
    shipped_autosave,
    shorten,
)
from wire.broker import Broker  # noqa: E402

ROUNDS = 2
CASES = [("SIGTERM", 2.0), ("SIGKILL", 2.0), ("SIGTERM", 30.0), ("SIGKILL", 30.0)]


def trial(fault: str | None, down: float) -> dict[str, object]:
    """One deployment of ``ROUNDS`` rounds; ``fault`` (SIGTERM, SIGKILL or None) hits the
    broker once round 1's batches flow."""
    with tempfile.TemporaryDirectory(prefix="faults-broker-") as folder:
        directory = Path(folder)
        with Broker(persistence=True, extra_config=shipped_autosave()) as broker:
            deployment = Deployment(
                broker.url, f"sqlite:///{directory / 'runs.db'}", directory, rounds=ROUNDS
            )
            shorten(deployment, PER_EDGE)
            streaming = Streaming(broker)
            try:
                coordinator = deployment.start_all()
                deployment.wait_until(lambda s: opened(s, 1), 600, "round 1")
                started = time.monotonic()  # planning and profiling apart
                if fault is not None and streaming.flowing(1).wait(300):
                    broker.restart(down=down, kill=fault == "SIGKILL")
                finished = coordinator.wait(900) == 0
                seconds = time.monotonic() - started
            finally:
                streaming.transport.close()
                deployment.stop()
            counted = count_batches(directory, list(EDGES), ["gpu-a"])
    return {
        "finished": finished,
        "seconds": seconds,
        "redone": sum(t - 1 for t in counted.tries.values()),
        "lost": counted.lost,
        "twice": counted.twice,
    }


def table(quick: bool) -> list[tuple[str, ...]]:
    """fault, down s, run finished, tries redone, extra s, batches lost, trained twice."""
    base = trial(None, 0.0)
    lines = []
    for fault, down in CASES[:2] if quick else CASES:
        result = trial(fault, down)
        extra = float(result["seconds"]) - float(base["seconds"])  # type: ignore[arg-type]
        lines.append(
            (
                f"broker {fault}",
                f"{down:.0f}",
                "yes" if result["finished"] else "NO",
                str(result["redone"]),
                f"{extra:+.0f}",
                str(result["lost"]),
                str(result["twice"]),
            )
        )
    return lines


def rows(quick: bool) -> list[tuple[str, str, str]]:
    """The shared fault table's rows (``benchmarks/faults.py``): fault, trials, outcome."""
    return [
        (
            f"{fault}, down {down} s",
            "1",
            f"finished {finished}, {redone} tries redone, {extra} s, {lost} lost, "
            f"{twice} trained twice",
        )
        for fault, down, finished, redone, extra, lost, twice in table(quick)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 2 s outages only")
    args = parser.parse_args()
    header = ("fault", "down s", "run finished", "rounds redone", "extra s", "lost", "twice")
    lines = [header, *table(args.quick)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))


if __name__ == "__main__":
    main()
