"""Chain forwarding: a GPU server holding a piece before the last block passes each trained
batch's output and labels on to the next piece's stream, and, once every sender of its round
is finished, says how many it passed on (its ``done``, like an edge's), so the next piece
agrees on the end of the round by the same counts. It passes batches on without credits (its
rate is bounded by its own training of credited input), but not before the next piece has
begun the round: the next piece's first credit says it holds the stream (a batch passed on
to a shared subscription nobody holds yet is dropped by the broker)."""

from __future__ import annotations

import threading

import numpy as np

from wire import topics
from wire.channel import Channel
from wire.flow import CreditGate

__all__ = ["ChainLink"]


class ChainLink:
    """Sends batches of ``run`` to the stream ``forward`` as ``channel.sender``."""

    def __init__(
        self, channel: Channel, run: str, forward: str, cut: int, encoding: str = "fp32"
    ) -> None:
        self.channel, self.run, self.forward = channel, run, forward
        self.cut, self.encoding = cut, encoding
        self._lock = threading.Lock()
        self._sent: dict[int, int] = {}  # round -> batches passed on
        self._attempt = 1  # the coordinator's try, which the next piece checks
        self._next = CreditGate(channel, run, channel.sender)  # the next piece's credits

    def await_next(self, round_number: int, attempt: int, timeout: float) -> bool:
        """Wait until the next piece has begun try ``attempt`` of the round (its first
        credit to this piece came); False after ``timeout`` seconds without it."""
        self._next.start_round(round_number, attempt)
        return self._next.acquire(timeout)

    def begin(self, round_number: int, attempt: int = 1) -> None:
        """Round ``round_number`` begins (again, when the runner retries it under the same
        number, as try ``attempt``): nothing of it has been passed on yet."""
        with self._lock:
            self._sent, self._attempt = {round_number: 0}, attempt

    def pass_on(self, output: dict[str, np.ndarray], labels: np.ndarray, round_number: int) -> None:
        """Send one trained batch's output (the input of block ``cut``: its tensors under their
        wire names) and its labels, numbered in the round as an edge numbers its batches (the
        next piece's log counts the distinct ones: docs/wire.md, "Counting")."""
        with self._lock:
            index = self._sent.get(round_number, 0)
        self.channel.send(
            topics.activations(self.run, self.forward, self.channel.sender),
            "activations",
            self.run,
            round=round_number,
            tensors={**output, "y": labels},
            meta={"cut": self.cut, "attempt": self._attempt, "batch": index},
            encoding=self.encoding,
        )
        with self._lock:
            self._sent = {r: n for r, n in self._sent.items() if r >= round_number}
            self._sent[round_number] = self._sent.get(round_number, 0) + 1

    def done(self, round_number: int) -> None:
        """Every batch of ``round_number`` has been passed on: tell the next piece how many."""
        with self._lock:
            batches = self._sent.get(round_number, 0)
        self.channel.send(
            topics.done(self.run, self.channel.sender),
            "round_control",
            self.run,
            round=round_number,
            meta={"batches": batches, "attempt": self._attempt},
        )
