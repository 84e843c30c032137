"""Helpers of the fault-injection suite (issue 17) and of ``benchmarks/faults.py``: the rounds
a deployment is at, a watch on the activation streams that says when a round is under way (a
kill lands mid-round, not before the first batch) and what each edge sent, and the check that
no batch was trained twice into a committed round."""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from storage import open_store
from storage.report import run_status
from tests.e2e.deployment import Deployment, committed, opened
from wire import topics
from wire.codec import decode
from wire.errors import WireError
from wire.mqtt import MqttConfig, MqttTransport

RUN = "e2e-1"  # the run id tests.e2e.deployment writes
BATCH = 32  # its batch size
# Waits are generous: CI runs on two shared cores, and planning profiles the model first.
START_TIMEOUT, ROUND_TIMEOUT = 300.0, 180.0


class StreamWatch:
    """Subscribes to every activation stream of the run (beside the GPU servers' shared
    subscription, so it takes nothing from them) and counts, per (sender, round, try), the
    batches and examples that crossed the broker."""

    def __init__(self, broker_url: str, run: str = RUN) -> None:
        self._lock = threading.Condition()
        self.batches: Counter[tuple[str, int, int]] = Counter()
        self.examples: Counter[tuple[str, int, int]] = Counter()
        self._transport = MqttTransport(
            MqttConfig.from_url(broker_url), f"fault-watch-{uuid.uuid4().hex[:6]}"
        )
        self._transport.subscribe(f"{topics.run_topic(run, 'act')}/+/+", self._on_batch)

    def _on_batch(self, _topic: str, payload: bytes) -> None:
        try:
            envelope = decode(payload)
        except WireError:
            return
        attempt = envelope.meta.get("attempt", 1)
        key = (envelope.sender, envelope.round, attempt if isinstance(attempt, int) else 1)
        with self._lock:
            self.batches[key] += 1
            self.examples[key] += len(envelope.tensors.get("y", ()))
            self._lock.notify_all()

    def sent(self, sender: str, number: int) -> int:
        """The batches ``sender`` streamed in round ``number``, over every try."""
        with self._lock:
            return sum(n for (s, r, _), n in self.batches.items() if (s, r) == (sender, number))

    def examples_of(self, sender: str, number: int) -> int:
        """The examples ``sender`` streamed in round ``number``, over every try."""
        with self._lock:
            return sum(n for (s, r, _), n in self.examples.items() if (s, r) == (sender, number))

    def wait_batches(self, sender: str, number: int, count: int, timeout: float) -> None:
        """Until ``count`` batches of ``sender`` in round ``number`` crossed the broker."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.sent(sender, number) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{sender} streamed {self.sent(sender, number)} batches of round "
                        f"{number} in {timeout:.0f} s, waited for {count}"
                    )
                self._lock.wait(min(left, 0.5))

    def close(self) -> None:
        self._transport.close()


@contextlib.contextmanager
def deployed(
    broker_url: str, directory: Path, **options: Any
) -> Iterator[tuple[Deployment, StreamWatch]]:
    """A deployment in ``directory`` (not started; ``options`` go to :class:`Deployment`)
    and a watch on its streams; every process it started is stopped on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(broker_url, f"sqlite:///{directory / 'runs.db'}", directory, **options)
    watch = StreamWatch(broker_url)
    try:
        yield deployment, watch
    finally:
        watch.close()
        deployment.stop()


def expected_batches(per_edge: int, local_epochs: int = 1) -> int:
    """The batches an edge holding ``per_edge`` examples streams in one round."""
    return math.ceil(per_edge / BATCH) * local_epochs


def status_of(deployment: Deployment) -> dict[str, Any]:
    """The run as ``edgesplit status --json`` shows it, read from the store in this process
    (the CLI's start costs seconds on a loaded machine)."""
    with open_store(deployment.db, readonly=True) as store:
        return run_status(store, RUN)


def wait_open(deployment: Deployment, number: int) -> dict[str, Any]:
    return deployment.wait_until(lambda s: opened(s, number), START_TIMEOUT, f"round {number}")


def wait_committed(deployment: Deployment, number: int) -> dict[str, Any]:
    return deployment.wait_until(
        lambda s: committed(s, number), ROUND_TIMEOUT, f"round {number} to commit"
    )


_TRAINED = re.compile(
    r"batches-trained run=(\S+) round=(\d+) try=(\d+) server=(\S+) sender=(\S+) "
    r"batches=(\d+) distinct=(\d+)"
)


def trained_lines(log: str, run: str = RUN) -> dict[int, dict[str, tuple[int, int]]]:
    """A GPU server's ``batches-trained`` lines (docs/wire.md, "Counting"): per round, the
    last try's (batches, distinct) per sender. A later try of a round replaces an earlier
    one: the last try a server answered is the one that committed."""
    tries: dict[int, tuple[int, dict[str, tuple[int, int]]]] = {}
    for match in _TRAINED.finditer(log):
        name, number, attempt, _, sender, batches, distinct = match.groups()
        if name != run:
            continue
        seen_try, senders = tries.get(int(number), (0, {}))
        if int(attempt) > seen_try:
            seen_try, senders = int(attempt), {}
        senders[sender] = (int(batches), int(distinct))
        tries[int(number)] = (seen_try, senders)
    return {number: senders for number, (_, senders) in tries.items()}


def read_log(directory: Path, name: str) -> str:
    """A process's whole log (a restarted process appends to it)."""
    path = directory / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def trained_twice(
    status: dict[str, Any], per_edge: int, watch: StreamWatch, server_log: str
) -> list[str]:
    """Why a committed round of ``status`` may hold a batch trained twice (empty: none).

    From the store: an edge that replied is weighted by the examples the GPU server trained
    of it, capped at its claim, so an edge stored with all ``per_edge`` examples had all of
    them trained; the server's own count then leaves room only for what the edges that did
    not reply streamed (``watch``): more means a batch was trained twice. From the server's
    ``batches-trained`` log lines (when it writes them): each sender's batches in the try
    that committed were distinct, and an edge that replied had each of its batches trained."""
    problems = []
    for record in (r for r in status["rounds"] if r["state"] == "committed"):
        number, devices = record["round"], record["devices"]
        servers = set(record["servers"])
        edges = [d for d in devices if d["device"] not in servers]
        replied = [d for d in edges if d["failure"] is None]
        short = [d["device"] for d in replied if d["examples"] != per_edge]
        if short:
            problems.append(f"round {number}: {short} stored fewer than {per_edge} examples")
        room = sum(watch.examples_of(d["device"], number) for d in edges if d["failure"])
        extra = record["server_examples"] - per_edge * len(replied)
        if not 0 <= extra <= room:
            problems.append(
                f"round {number}: the GPU server trained {record['server_examples']} examples,"
                f" the edges that replied hold {per_edge * len(replied)} and the others "
                f"streamed {room}"
            )
        for sender, (batches, distinct) in trained_lines(server_log).get(number, {}).items():
            if batches != distinct:
                problems.append(f"round {number}: {sender}: {batches} batches, {distinct} distinct")
            if sender in {d["device"] for d in replied} and batches != expected_batches(per_edge):
                problems.append(f"round {number}: {sender}: {batches} batches trained")
    return problems
