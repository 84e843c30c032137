"""One round engine for every method: select through the strategy, send, collect, retry.

A round's messages come from a ``prepare`` callable (the split coordinator's streams and
tasks, or the whole model for the baselines); :class:`RoundRunner` samples the devices with
the strategy's ``configure_train`` (whose config entries every message carries), sends the
messages, collects replies until all came, the deadline passed or every missing device is
offline, and hands a sufficient round to its :class:`~coordinator.recorder.RoundRecorder`;
otherwise it retries, up to ``attempts`` times. Federated evaluation goes through the
strategy's ``configure_evaluate`` / ``aggregate_evaluate``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from coordinator.aggregation import WEIGHT_KEY, flower_quiet
from coordinator.bench import Bench
from coordinator.bounds import EXAMPLES_BOUND, cap_examples
from coordinator.devices import GracefulNodes
from coordinator.errors import CoordinatorError
from coordinator.guard import divergence
from coordinator.outage import (
    RETRY_CAP_SECONDS,
    LinkWatch,
    fail_repeat_losers,
    lost_senders,
    missing_batches,
    retry_delay,
    wait_for_more,
)
from coordinator.recorder import Outcome, RoundRecorder
from coordinator.replies import (
    bound_examples,
    claimed_examples,
    malformed_evaluation,
    name_failed,
    outcome_of,
)
from storage.records import RoundRecord
from wire.flower import TransportGrid, array_record
from wire.logs import printable
from wire.presence import WillGrace

__all__ = [
    "RETRY_CAP_SECONDS",
    "EdgeView",
    "RoundRunner",
    "RoundWork",
    "Sampled",
    "Settle",
    "retry_delay",
    "shortfall",
    "wait_for_more",
]

log = logging.getLogger(__name__)
_POLL = 0.1
_OUTAGE = object()  # a try the broker's going away cut short: redone, not counted
_UNREADY = object()  # a try that could not run (devices offline): counted per deadline waited
Sampled = dict[int, dict[str, Any]]
"""The nodes the strategy chose, each with the config entries of its train message."""
Settle = Callable[[int, dict[str, np.ndarray], list[str]], dict[str, np.ndarray]]
"""Round, its aggregate and the edges that trained -> the aggregate to evaluate and commit."""


@dataclass
class RoundWork:
    """One attempt of a round: who takes part and the train message of each device.

    ``servers``: the devices that must all answer, by the piece of the model they hold
    (``require_server``: at least one must have been sent work); ``problem``: why this
    attempt cannot run (the round still opens with ``participants``); ``mirrors``: the edges'
    head tensors that are replicas of the back's (head name -> the back's, ``head_from_back``);
    ``absent``: the plan's edges that were offline when it began (sent nothing)."""

    participants: list[str]
    messages: dict[str, Message] = field(default_factory=dict)
    servers: dict[str, tuple[int, int]] = field(default_factory=dict)
    require_server: bool = False
    problem: str | None = None
    mirrors: dict[str, str] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)  # planned edges offline as it began


def shortfall(
    sent: Collection[str],
    servers: Mapping[str, tuple[int, int]],
    require_server: bool,
    outcome: Outcome,
    min_edges: int,
) -> str | None:
    """Why ``outcome`` cannot commit: a piece of the back (``servers``: device -> blocks) that
    was ``sent`` work did not answer, no server had work though one is required, or fewer than
    ``min_edges`` edges trained; None when it can."""
    spans = {s for d, s in servers.items() if d in sent}
    spans_ok = {s for d, s in servers.items() if d in outcome.ok}
    edges_ok = [d for d in outcome.ok if d not in servers]
    if (spans or not require_server) and spans_ok == spans and len(edges_ok) >= min_edges:
        return None
    failed = [f"{r.device}: {r.failure}" for r in outcome.results if r.failure]
    return "; ".join(failed) or "not enough replies"


class EdgeView(Grid):
    """The grid as the strategy's sampler sees it: only the given nodes."""

    def __init__(self, grid: Grid, nodes: Callable[[], list[int]]) -> None:
        self._grid, self._nodes = grid, nodes

    def get_node_ids(self) -> list[int]:
        return self._nodes()

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Any) -> Any:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Any) -> Any:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        return self._grid.send_and_receive(messages, timeout=timeout)


_OUTAGE_NOTE = (
    "the coordinator lost the broker during try {attempt}; the round is redone from the last "
    "committed weights once its devices are back (not counted as an attempt)"
)


class RoundRunner:
    """Runs rounds over ``grid`` with ``strategy``; commits through ``recorder``."""

    def __init__(
        self,
        grid: TransportGrid,
        strategy: FedAvg,
        recorder: RoundRecorder,
        seed: int,
        deadline: float,
        attempts: int = 3,
        min_edges: int = 1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_attempt: Callable[[int, int], None] | None = None,
    ) -> None:
        """``on_attempt(round, attempt)``: told before a try's messages go out (the
        coordinator announces it, so devices still at an earlier try give that up)."""
        self.grid, self.strategy, self.recorder = grid, strategy, recorder
        self.on_attempt = on_attempt or (lambda _number, _attempt: None)
        self.first_try: dict[int, int] = {}  # round -> its first try's number (a resumed one's)
        self.seed, self.deadline = seed, deadline
        self.attempts, self.min_edges = attempts, min_edges
        self.bench = Bench()  # edges online that answer nothing are not waited for every round
        self._clock, self._sleep = clock, sleep
        transport = getattr(grid, "transport", None)
        self.link = LinkWatch(transport, clock, sleep)
        self._nodes = GracefulNodes(grid, transport, WillGrace(clock=clock))
        self.reported: dict[str, dict[str, Any]] = {}  # the last committed round's metrics
        self.stop_check: Callable[[], None] = lambda: None  # raises to stop the run (tries, waits)
        self.settle: Settle = lambda _number, merged, _edges: merged  # before it is evaluated
        self._lost: tuple[int, set[str]] = (0, set())  # senders missing batches in a round's try

    def sample(
        self, number: int, nodes: Sequence[int], weights: Mapping[str, np.ndarray]
    ) -> Sampled:
        """The online ``nodes`` the strategy chooses for round ``number``, reproducibly."""
        online = sorted(set(nodes) & set(self.grid.get_node_ids()))
        online = self.bench.choose(number, online, self.min_edges)
        view = EdgeView(self.grid, lambda: online)
        if not (available := len(view.get_node_ids())):
            return {}
        # Flower samples max(fraction_train x available, this): the run's least, up to those
        # online (Flower waits for more in a loop of its own; fewer left every try short)
        self.strategy.min_train_nodes = min(self.min_edges, available)
        random.seed(self.seed * 100_003 + number)
        with flower_quiet():  # Flower logs each round's sample at INFO
            messages = self.strategy.configure_train(
                number, array_record(weights), ConfigRecord(), view
            )
        return {
            m.metadata.dst_node_id: dict(m.content.config_records[self.strategy.configrecord_key])
            for m in messages
        }

    def run(
        self,
        number: int,
        prepare: Callable[[int], RoundWork],
        evaluate: Callable[[int, dict[str, np.ndarray], list[str]], dict[str, float]] | None = None,
        start: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Round ``number``'s new weights, after at most ``attempts`` tries of ``prepare``'s
        work; ``evaluate`` adds the federated evaluation by the edges that trained. ``start``:
        the weights the round starts from, evaluated to judge the first round by when no
        committed round precedes it."""
        previous = self.recorder.committed(number - 1) or self.recorder.baseline(start)
        attempt, counted, outages, unready, waited = self.first_try.pop(number, 1) - 1, 0, 0, 0, 0.0
        while counted < self.attempts:
            attempt += 1
            tries = (attempt, counted + 1, unready + 1)
            result = self._try(number, tries, prepare, (evaluate, previous))
            if isinstance(result, dict):
                return result
            if result is _UNREADY:  # waiting for devices costs an attempt per deadline
                attempt -= 1  # nothing was announced: the next try that runs takes its number
                unready, waited = unready + 1, waited + retry_delay(unready + 1)
                if waited >= self.deadline:
                    counted, unready, waited = counted + 1, 0, 0.0
            elif result is None:
                counted, unready, waited = counted + 1, 0, 0.0
            elif (outages := outages + 1) > self.link.tries:
                raise CoordinatorError(
                    f"round {number}: the broker went away during {outages} tries; see "
                    f"`edgesplit status --run {self.recorder.run_id}` and the run's events"
                )
        last = self.recorder.last_failure
        mu = getattr(self.strategy, "proximal_mu", 0.0)  # FedProx's pull can diverge too
        advice = "lower the learning rate" + (f" or proximal_mu ({mu:g})" if mu > 0 else "")
        hint = f"; it diverged: {advice}" if "not committed" in last else ""
        raise CoordinatorError(
            f"round {number} failed {self.attempts} times (last: {last}){hint}; see "
            f"`edgesplit status --run {self.recorder.run_id}` and the run's events"
        )

    def _try(
        self,
        number: int,
        tries: tuple[int, int, int],
        prepare: Callable[[int], RoundWork],
        judge: tuple[Any, RoundRecord | None],
    ) -> dict[str, np.ndarray] | object | None:
        """One try of round ``number`` (``tries``: its number as announced, as counted
        against ``attempts``, and among the tries in a row that could not run): the new
        weights, :data:`_OUTAGE` when the broker went away during it, :data:`_UNREADY` when
        it could not run (devices offline: waited for, see :func:`wait_for_more`), or None
        when it failed."""
        attempt, counted, unready = tries
        self.stop_check()
        started = self._clock()
        self.recorder.observer.round_starting(number)
        work = prepare(number)
        self.recorder.open(number, work.participants)
        if work.problem is not None:
            if unready == 1:  # once per counted attempt: the back-off's waits are no failures
                self.recorder.waiting(number, counted, self.attempts, work.problem)
            wait_for_more(self.grid.get_node_ids, retry_delay(unready), self._sleep)
            return _UNREADY
        _stamp(number, (attempt, counted), work.messages, self.deadline)
        self.on_attempt(number, attempt)
        self.recorder.observer.round_started(number, list(work.messages))
        epoch = self.link.epoch()
        replies = self.collect(work.messages, self.deadline)
        if self.link.epoch() != epoch:
            self._outage(number, attempt, work)
            return _OUTAGE
        online = set(self.grid.get_node_ids())
        outcome = outcome_of(work.messages, replies, started, online, self._clock())
        self.bench.after(number, outcome, work.messages, self.recorder.event, work.servers)
        servers = [d for d in work.servers if d in outcome.ok]
        lost, (last, before) = lost_senders(servers, replies), self._lost
        self._lost = number, lost
        repeated = fail_repeat_losers(outcome, lost, before if last == number else set())
        why = shortfall(
            work.messages, work.servers, work.require_server, outcome, self.min_edges
        ) or (None if repeated else missing_batches(servers, replies))
        if why is None:
            merged, why = self._commit(number, work, replies, outcome, judge)
            if merged is not None:
                return merged
        self.recorder.record(number, outcome)
        self.recorder.failed(number, counted, self.attempts, why)
        return None

    def _outage(self, number: int, attempt: int, work: RoundWork) -> None:
        """The coordinator lost the broker during try ``attempt``: record it (unless told to
        stop: e.g. its run was taken over) and wait until the link and the devices are back."""
        self.stop_check()
        self.recorder.event(number, "broker-outage", _OUTAGE_NOTE.format(attempt=attempt))
        nodes = [m.metadata.dst_node_id for m in work.messages.values()]
        self.link.wait_back(nodes, self.grid.get_node_ids)

    def _commit(
        self,
        number: int,
        work: RoundWork,
        replies: dict[str, Message],
        outcome: Outcome,
        judge: tuple[Any, RoundRecord | None],
    ) -> tuple[dict[str, np.ndarray] | None, str]:
        """Aggregate, evaluate and commit a sufficient attempt: its weights, or None and why
        it did not commit. ``judge``: the federated evaluation (or None) and the round the
        new one is judged against."""
        _name_nodes(self.strategy, work)
        ok = sorted(outcome.ok)
        name_failed(self.recorder, number, outcome, work.absent)
        bound_examples(self.recorder, self.strategy, (number, work.servers), replies, outcome)
        merged = self.recorder.aggregate(number, [replies[d] for d in ok], ok)
        if merged is None:
            return None, "the strategy aggregated nothing"
        trained = [d for d in ok if d not in work.servers]
        merged, evaluation, diverged = _judged(self, number, merged, trained, (outcome, judge))
        if diverged is not None:
            return None, f"not committed: {diverged}"
        self.recorder.commit(number, merged, outcome, evaluation, list(work.servers))
        self.reported = {d: dict(replies[d].content.metric_records["metrics"]) for d in ok}
        return merged, ""

    def collect(
        self, messages: dict[str, Message], deadline: float, observed: bool = True
    ) -> dict[str, Message]:
        """Replies by device, until all came, the deadline passed, or every device still
        missing went offline since its message went out (its last will counted): an agent
        restarted meanwhile is online again but knows nothing of the message."""
        epoch = self.link.epoch()  # before sending: a message sent into an outage may be lost
        ids = dict(zip(self.grid.push_messages(messages.values()), messages, strict=True))
        nodes = {device: m.metadata.dst_node_id for device, m in messages.items()}
        replies: dict[str, Message] = {}
        gone: set[str] = set()  # offline since their message went out: a restart forgets it
        until = self._clock() + deadline
        while len(replies) < len(messages) and self._clock() < until:
            for reply in self.grid.pull_messages([i for i, d in ids.items() if d not in replies]):
                device = ids[reply.metadata.reply_to_message_id]
                replies[device] = reply
                if observed:
                    self.recorder.observer.device_answered(device)
            waiting = [d for d in messages if d not in replies]
            online = self._nodes()
            gone |= {d for d in waiting if nodes[d] not in online}
            if waiting and gone >= set(waiting):
                break
            if self.link.epoch() != epoch:
                break  # the broker went away: the try is redone (run)
            self.stop_check()
            self._sleep(_POLL)
        self.grid.abandon([i for i, d in ids.items() if d not in replies])
        return replies

    def federated(
        self,
        number: int,
        weights: Mapping[str, np.ndarray],
        devices: Mapping[str, int],
        message: Callable[[str, Message], Message],
    ) -> dict[str, float]:
        """The strategy's federated evaluation of ``weights`` by ``devices`` (name -> node):
        its ``configure_evaluate`` picks them and ``message`` addresses each one (adding its
        task); ``aggregate_evaluate`` weighs their accuracy and loss by their examples
        (keys ``federated_*``). Devices that fail or do not answer in time are left out."""
        by_node = {node: name for name, node in devices.items()}
        online = set(self.grid.get_node_ids())
        view = EdgeView(self.grid, lambda: sorted(n for n in by_node if n in online))
        if not view.get_node_ids():
            return {}
        with flower_quiet():
            configured = self.strategy.configure_evaluate(
                number, array_record(weights), ConfigRecord(), view
            )
        messages = {
            by_node[m.metadata.dst_node_id]: message(by_node[m.metadata.dst_node_id], m)
            for m in configured
        }
        replies = self.collect(messages, self.deadline / 2, observed=False)
        counted = _usable_evaluations(replies, self.strategy)
        if not counted:
            return {}
        with flower_quiet():
            metrics = self.strategy.aggregate_evaluate(number, [*counted.values()])
        if metrics is None:
            return {}
        examples = sum(claimed_examples(r) for r in counted.values())
        return {
            "federated_accuracy": float(metrics["accuracy"]),  # type: ignore[arg-type]
            "federated_loss": float(metrics["loss"]),  # type: ignore[arg-type]
            "federated_examples": examples,
        }


def _judged(
    runner: RoundRunner,
    number: int,
    merged: dict[str, np.ndarray],
    trained: list[str],
    context: tuple[Outcome, tuple[Any, RoundRecord | None]],
) -> tuple[dict[str, np.ndarray], dict[str, float], str | None]:
    """The aggregate as settled (e.g. BatchNorm statistics measured anew by the ``trained``
    edges), its evaluation, and why the divergence guard refuses it (None: it does not).
    Settled weights the guard refuses while the aggregate as it was passes are dropped for
    it, with an event: what edges measured must not cost the round (an edge may lie)."""
    outcome, (evaluate, previous) = context

    def judge(weights: dict[str, np.ndarray]) -> tuple[dict[str, float], str | None]:
        evaluation = runner.recorder.central_evaluation(weights)
        if evaluate is not None:
            evaluation |= evaluate(number, weights, trained)
        return evaluation, divergence(weights, evaluation, outcome.results, previous, trained)

    settled = runner.settle(number, merged, trained)
    evaluation, diverged = judge(settled)
    if diverged is None or settled is merged:
        return settled, evaluation, diverged
    plain, why = judge(merged)
    if why is not None:
        return settled, evaluation, diverged
    runner.recorder.event(
        number,
        "statistics-dropped",
        f"with the BatchNorm statistics the edges measured the round was refused ({diverged}); "
        "it keeps the averaged ones",
    )
    return merged, plain, None


def _name_nodes(strategy: FedAvg, work: RoundWork) -> None:
    """Tell the strategy each node's device name, which nodes are GPU servers (trusted: a
    robust rule never clips them) and which head tensors are replicas of the back's."""
    strategy.node_names = {  # type: ignore[attr-defined]
        m.metadata.dst_node_id: d for d, m in work.messages.items()
    }
    strategy.trusted_nodes = frozenset(  # type: ignore[attr-defined]
        work.messages[d].metadata.dst_node_id for d in work.servers if d in work.messages
    )
    strategy.mirrors = work.mirrors  # type: ignore[attr-defined]


def _stamp(
    number: int, tries: tuple[int, int], messages: Mapping[str, Message], deadline: float
) -> None:
    """Each message of a try carries its number (devices tell a retry's credits apart) and
    batch order; the try is said (a round's start was silent in the coordinator's log)."""
    attempt, counted = tries
    for message in messages.values():
        message.content.config_records["config"]["attempt"] = attempt
        message.content.config_records["config"]["order"] = counted  # its batch order
    sent = sorted(messages)
    log.info(
        "round %d%s: work sent to %d device(s) (%s%s); deadline %.0f s",
        *(number, f" try {attempt}" if attempt > 1 else "", len(sent), ", ".join(sent[:8])),
        *(", ..." if len(sent) > 8 else "", deadline),
    )


def _usable_evaluations(replies: Mapping[str, Message], strategy: FedAvg) -> dict[str, Message]:
    """The evaluation ``replies`` that can be counted, by device, their claimed examples
    bounded (:func:`_bound_evaluation`); the others are named in a warning."""
    counted: dict[str, Message] = {}
    for device, reply in sorted(replies.items()):
        if reply.has_error():
            log.warning(
                "federated evaluation on %s failed: %s", device, printable(reply.error.reason)
            )
        elif (problem := malformed_evaluation(reply)) is not None:
            log.warning("federated evaluation on %s left out: %s", device, problem)
        elif claimed_examples(reply) > 0:
            counted[device] = reply
    _bound_evaluation(counted, float(getattr(strategy, "examples_bound", EXAMPLES_BOUND)))
    return counted


def _bound_evaluation(replies: Mapping[str, Message], factor: float) -> None:
    """Each device's claimed test examples (its weight in the federated accuracy and loss)
    capped at ``factor`` times its peers' median claim: no GPU server counts what a device
    evaluates, and one claiming a billion examples would set the reported figures alone."""
    claims = {d: claimed_examples(reply) for d, reply in replies.items()}
    for cap in cap_examples(claims, None, factor):
        replies[cap.device].content.metric_records["metrics"][WEIGHT_KEY] = cap.allowed
        log.warning("federated evaluation on %s: %s", cap.device, cap)
