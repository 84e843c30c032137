"""Helpers of the broker-restart test and benchmark: a watch that says when a round's batches
flow, shorter edge data, the shipped broker's autosave, and counting batches from a
deployment's logs (docs/wire.md, "Counting"): each edge logs the
batches it sent per round and try (``batches-sent``), each GPU server the batches it trained
per sender (``batches-trained``, with how many were distinct). The committed try of a round is
its last one (a finished run commits every round, and nothing follows a commit)."""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.e2e.cli import ROOT
from tests.e2e.deployment import Deployment
from wire import topics
from wire.broker import Broker
from wire.codec import read_header
from wire.mqtt import MqttConfig, MqttTransport

__all__ = [
    "PER_EDGE",
    "BatchCount",
    "Streaming",
    "count_batches",
    "shipped_autosave",
    "shorten",
]

_SENT = re.compile(r"batches-sent run=\S+ round=(\d+) try=(\d+) device=(\S+) batches=(\d+)")
_TRAINED = re.compile(
    r"batches-trained run=\S+ round=(\d+) try=(\d+) server=\S+ sender=(\S+) "
    r"batches=(\d+) distinct=(\d+)"
)


@dataclass(frozen=True)
class BatchCount:
    """The committed tries' batches: sent by the edges, lost (sent, never trained) and
    trained twice; ``tries``: the committed try of each round."""

    sent: int
    lost: int
    twice: int
    tries: dict[int, int]


def count_batches(directory: Path, edges: list[str], servers: list[str]) -> BatchCount:
    """What the logs in ``directory`` (``<process>.log``) say of every round's last try."""
    sent: dict[tuple[int, int, str], int] = {}
    trained: dict[tuple[int, int, str], list[int]] = defaultdict(lambda: [0, 0])
    for edge in edges:
        for match in _SENT.finditer(_read(directory, edge)):
            number, attempt, device, batches = match.groups()
            sent[int(number), int(attempt), device] = int(batches)
    for server in servers:
        for match in _TRAINED.finditer(_read(directory, server)):
            number, attempt, sender, batches, distinct = match.groups()
            total = trained[int(number), int(attempt), sender]
            total[0] += int(batches)
            total[1] += int(distinct)
    tries: dict[int, int] = {}
    for number, attempt, _ in [*sent, *trained]:
        tries[number] = max(tries.get(number, 0), attempt)
    lost = twice = total_sent = 0
    for number, attempt in tries.items():
        for edge in edges:
            count = sent.get((number, attempt, edge), 0)
            done, distinct = trained.get((number, attempt, edge), [0, 0])
            total_sent += count
            lost += max(0, count - distinct)
            twice += done - distinct + max(0, distinct - count)
    return BatchCount(total_sent, lost, twice, tries)


SHIPPED = ROOT / "deploy" / "mosquitto" / "mosquitto.conf"
PER_EDGE = 320  # 10 batches an edge a round: short rounds, still several batches to lose


class Streaming:
    """Says when a round's activations are flowing (a restart then lands mid-stream): a
    watcher on every activation topic of the run, reading only the header's round."""

    def __init__(self, broker: Broker) -> None:
        self.rounds: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        config = MqttConfig.from_url(broker.url, fresh_session=True)
        self.transport = MqttTransport(config, "stream-watch")
        self.transport.subscribe(f"{topics.run_topic('e2e-1', 'act')}/#", self._on_batch)

    def _on_batch(self, _topic: str, payload: bytes) -> None:
        number = read_header(payload).get("round")
        if isinstance(number, int):
            self.flowing(number).set()

    def flowing(self, number: int) -> threading.Event:
        with self._lock:
            return self.rounds.setdefault(number, threading.Event())


def shorten(deployment: Deployment, per_edge: int) -> None:
    """Keep the first ``per_edge`` examples of each edge's data."""
    for path in deployment.data:
        with np.load(path) as archive:
            x, y = archive["x"][:per_edge], archive["y"][:per_edge]
        np.savez(path, x=x, y=y)


def shipped_autosave() -> str:
    """The shipped broker's autosave lines (the test broker saves as production does)."""
    lines = SHIPPED.read_text().splitlines()
    return "\n".join(line for line in lines if re.match(r"autosave_\w+ ", line)) + "\n"


def _read(directory: Path, process: str) -> str:
    path = directory / f"{process}.log"
    return path.read_text(errors="replace") if path.exists() else ""
