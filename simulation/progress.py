"""A live view of a run's rounds (rich): a bar for the round in progress (devices answered) and
a table of committed rounds. On a terminal it redraws in place; elsewhere (logs, CI) it prints
one line per committed round. Quiet runs use the base :class:`RoundObserver`, which shows
nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.service import RoundObserver

__all__ = ["RoundProgress"]


class RoundProgress(RoundObserver):
    """Shows the progress of ``rounds`` rounds on ``console`` (stderr by default); ``unit``:
    what the edges are (``hosts`` when a simulation groups its clients); ``fleet``: how many
    there are, said where a round sent work to fewer (offline, or not sampled)."""

    def __init__(
        self,
        rounds: int,
        title: str,
        console: Console | None = None,
        unit: str = "clients",
        fleet: int | None = None,
    ) -> None:
        self.rounds, self.title, self.unit, self.fleet = rounds, title, unit, fleet
        self.console = console or Console(stderr=True)
        self._lock = threading.Lock()
        self._rows: list[tuple[str, ...]] = []
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("waiting for the plan", total=None)
        self._started = 0.0
        self._live: Live | None = None

    def __enter__(self) -> RoundProgress:
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.__enter__()
        else:  # the bar's "waiting for the plan": a first model's profile takes a minute
            self.console.print(
                f"{self.title}: profiling the model and planning the cuts, then "
                f"{self.rounds} round{'s' * (self.rounds != 1)}",
                soft_wrap=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)

    def _table(self) -> Table:
        table = Table(title=self.title, title_justify="left")
        names = ["round", "accuracy", "loss", f"{self.unit} trained", "wall s"]
        federated = any(len(row) > len(names) for row in self._rows)
        for name in names + (["federated accuracy"] if federated else []):
            table.add_column(name, justify="right")
        for row in self._rows:
            table.add_row(*row, *([""] if federated and len(row) == len(names) else []))
        return table

    def _render(self) -> Group:
        return Group(self._table(), self._progress)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    # ---------------------------------------------------------------- RoundObserver
    def round_started(self, number: int, devices: list[str]) -> None:
        with self._lock:
            self._started = time.monotonic()
            self._progress.reset(
                self._task,
                total=len(devices),
                completed=0,
                description=f"round {number}/{self.rounds}: devices done",
            )
            self._refresh()

    def device_answered(self, device: str) -> None:
        with self._lock:
            self._progress.advance(self._task)
            self._refresh()

    def round_committed(
        self,
        number: int,
        evaluation: dict[str, float],
        results: Any,
        servers: Sequence[str] = (),
        clients: int | None = None,
    ) -> None:
        edges = [r for r in results if r.device not in servers]  # the servers' work apart
        trained = sum(1 for r in edges if not r.failure)
        of_clients = "" if clients is None else f" ({clients} client{'s' * (clients != 1)})"
        count = f"{trained}/{len(edges)}{self._of_fleet(len(edges))}"
        row: tuple[str, ...] = (
            str(number),
            f"{evaluation.get('accuracy', float('nan')):.4f}",
            f"{evaluation.get('loss', float('nan')):.4f}",
            f"{count}{of_clients}",
            f"{time.monotonic() - self._started:.1f}",
        )
        # the edges' own held-out data (training.federated_eval), where the run measures it
        federated = evaluation.get("federated_accuracy")
        if federated is not None:
            row = (*row, f"{federated:.4f}")
        with self._lock:
            self._rows.append(row)
            if self._live is None:
                on_edges = "" if federated is None else f", on the edges' data {row[5]}"
                self.console.print(  # one line a round, however wide (logs are read by line)
                    f"round {row[0]}/{self.rounds}: accuracy {row[1]}{on_edges}, loss {row[2]}, "
                    f"{count} {self.unit} trained{of_clients}, {row[4]} s",
                    soft_wrap=True,
                )
            self._refresh()

    def _of_fleet(self, sent: int) -> str:
        """`` of N`` where the round sent work to fewer than the fleet's ``N``."""
        return f" of {self.fleet}" if self.fleet is not None and self.fleet > sent else ""
