"""The edge agent: a device that announces itself and trains whatever prefix a round assigns.

The agent keeps no assignment state: every ``train`` message carries its :class:`~wire.roles.Task`
(model, blocks, optimizer, deadline), so an agent restarted mid-run serves the next round it is
sent. A task whose memory estimate exceeds the agent's budget is refused with the reason; the
coordinator asks first (a ``query`` message) and plans around a refusal. Each round the agent
measures the real peak memory of its training (resident high-water mark above the level at the
round's start) and reports it with the estimate.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edge_client.source import OwnSegment, SegmentSource
from edge_client.trainer import EdgeRoundReport, EdgeTrainer, EdgeTrainerConfig
from split_models.data import Dataset
from split_models.evaluation import evaluate_weights
from split_models.measure import PeakMeter, peak_supported
from split_models.segment import OptimizerConfig, Segment
from split_models.units import format_bytes
from split_models.zoo import build_model
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.flow import CreditGate
from wire.flower import array_record, numpy_arrays, round_of
from wire.roles import Announcement, Task, go_online
from wire.session import RoundAbandoned, SessionWatch
from wire.transport import Transport

__all__ = ["AssignmentRefused", "EdgeAgent"]

log = logging.getLogger(__name__)


class AssignmentRefused(RuntimeError):
    """The task does not fit this device; the message says why."""


@dataclass
class _Built:
    key: str
    trainer: EdgeTrainer


def _warm_up(segment: Segment, data: Dataset, encoding: str) -> None:
    """One training step on a copy of the segment at a batch of 2, and its encoding: the
    runtime's one-time set-up (autograd engine, kernel libraries, codec) happens here, not in
    the first round, whose peak is compared against the budget. Kernels set up per batch shape
    still happen in the round and are part of the estimate."""
    twin = copy.deepcopy(segment)
    count = min(2, len(data))
    result = twin.train_step(torch.from_numpy(data.x[:count]), torch.from_numpy(data.y[:count]))
    envelope = Envelope("activations", "warm-up", "warm-up", 0, 0, {}, {"x": result.output.numpy()})
    encode(envelope, encoding)


def _segment_key(task: Task) -> str:
    """What a built segment depends on (not the run's bookkeeping or this round's weights)."""
    fields = ("model", "input_shape", "num_classes", "start", "end", "local_loss", "optimizer")
    return json.dumps({name: getattr(task, name) for name in fields}, sort_keys=True)


class EdgeAgent:
    """Serves Flower ``query`` (assignment check) and ``train`` (one round) messages."""

    def __init__(
        self,
        announcement: Announcement,
        data: Dataset,
        control: Transport,
        stream: Transport,
        budget: int | None = None,
        measure_peak: bool = True,
        source: SegmentSource | None = None,
    ) -> None:
        """``budget``: the memory training may use now, when it is below what the device
        announced (other work on the device); assignments are checked against it.
        ``source``: where the agent gets built segments (a host running many agents shares
        one); by default the agent builds and keeps its own."""
        if announcement.role != "edge":
            raise ValueError("an edge agent announces the role 'edge'")
        self.announcement, self.data = announcement, data
        self.device = announcement.device
        self.budget = announcement.memory if budget is None else budget
        # The peak is the process's high-water mark: meaningful only with one agent a process
        # (simulation runs many agents in one process and turns it off).
        self.measure_peak = measure_peak
        self.channel = Channel(stream, self.device)
        self.sessions = SessionWatch(stream)
        self._gates: dict[str, CreditGate] = {}
        self._gates_lock = threading.Lock()
        self._built: _Built | None = None
        self._split: tuple[tuple[float, int], Dataset, Dataset] | None = None
        self.source = OwnSegment() if source is None else source
        self.rounds = 0
        # One subscription for every run, made before the node goes online: a server may
        # grant credits before this agent has seen its task.
        self.channel.subscribe(
            topics.credit_filter(self.device),
            lambda envelope: self._gate(envelope.run).on_credit(envelope),
            kinds=frozenset({"credit"}),
        )
        self.node = go_online(announcement, control, self.client_app())

    def _gate(self, run: str) -> CreditGate:
        with self._gates_lock:
            if run not in self._gates:
                self._gates[run] = CreditGate(self.channel, run, self.device, subscribe=False)
            return self._gates[run]

    # ---------------------------------------------------------------- decisions
    def check(self, task: Task) -> None:
        """Raise :class:`AssignmentRefused` unless ``task`` fits this device and its data."""
        if tuple(self.data.x.shape[1:]) != task.input_shape:
            raise AssignmentRefused(
                f"{self.device}: local data has samples of shape {list(self.data.x.shape[1:])}, "
                f"the model expects {list(task.input_shape)}"
            )
        if int(self.data.y.max()) >= task.num_classes:
            raise AssignmentRefused(
                f"{self.device}: local labels reach {int(self.data.y.max())}, "
                f"the model has {task.num_classes} classes"
            )
        budget = self.budget
        if task.estimated_peak_bytes > budget:
            raise AssignmentRefused(
                f"{self.device}: blocks [{task.start}, {task.end}) need an estimated "
                f"{format_bytes(task.estimated_peak_bytes)}, the budget is {format_bytes(budget)}"
            )

    def _datasets(self, task: Task) -> tuple[Dataset, Dataset | None]:
        """The data this agent trains on and, with federated evaluation (``eval_fraction`` in
        the task), the share it holds out for evaluating the assembled model."""
        fraction = task.extra.get("eval_fraction")
        if not isinstance(fraction, float | int) or not 0 < fraction < 1 or len(self.data) < 2:
            return self.data, None
        key = (float(fraction), task.seed)
        if self._split is None or self._split[0] != key:
            self._split = (key, *self.data.split(float(fraction), seed=task.seed))
        return self._split[1], self._split[2]

    def _build_segment(self, task: Task) -> Segment:
        model = build_model(task.model, task.input_shape, task.num_classes, seed=task.seed)
        segment = Segment.from_model(
            model, task.start, task.end, task.local_loss, OptimizerConfig(**task.optimizer)
        )
        _warm_up(segment, self.data, task.compression)
        return segment

    def _trainer(self, task: Task, segment: Segment) -> EdgeTrainer:
        key = Task(**{**task.__dict__, "deadline_seconds": 1.0, "estimated_peak_bytes": 0})
        key_text = key.to_json()
        if self._built is None or self._built.key != key_text:
            config = EdgeTrainerConfig(
                task.run,
                self.device,
                task.segment,
                batch_size=task.batch_size,
                local_epochs=task.local_epochs,
                encoding=task.compression,
                credit_timeout=task.deadline_seconds,
                mode=task.mode,
            )
            train, _ = self._datasets(task)
            trainer = EdgeTrainer(self.channel, self._gate(task.run), segment, train, config)
            self._built = _Built(key_text, trainer)
        self._built.trainer.segment = segment
        return self._built.trainer

    # ---------------------------------------------------------------- Flower
    def client_app(self) -> ClientApp:
        app = ClientApp()

        @app.query()
        def query(message: Message, _context: Context) -> Message:
            task = Task.parse(str(message.content.config_records["config"]["task"]))
            try:
                self.check(task)
                accepted, reason = 1, ""
            except AssignmentRefused as refusal:
                accepted, reason = 0, str(refusal)
                log.warning("refused an assignment: %s", refusal)
            content = RecordDict(
                {
                    "metrics": MetricRecord({"accepted": accepted, "budget": self.budget}),
                    "answer": ConfigRecord({"reason": reason}),
                }
            )
            return Message(content, reply_to=message)

        @app.train()
        def train(message: Message, _context: Context) -> Message:
            task = Task.parse(str(message.content.config_records["config"]["task"]))
            self.check(task)
            try:
                return self._train(message, task, self.sessions.follow(task.run, task.session))
            except RoundAbandoned as abandoned:
                log.warning("%s", abandoned)
                return Message(Error(code=2, reason=str(abandoned)), reply_to=message)

        @app.evaluate()
        def evaluate(message: Message, _context: Context) -> Message:
            task = Task.parse(str(message.content.config_records["config"]["task"]))
            _, held_out = self._datasets(task)
            if held_out is None:
                result, count = {"accuracy": 0.0, "loss": 0.0}, 0
            else:
                weights = numpy_arrays(message)
                with self.source.slot():  # on a shared host, bounded as training is
                    result = evaluate_weights(
                        task.model, task.input_shape, task.num_classes, weights, held_out, 64
                    )
                count = len(held_out)
            metrics = MetricRecord({"num-examples": count, **result})
            return Message(RecordDict({"metrics": metrics}), reply_to=message)

        return app

    def _train(self, message: Message, task: Task, cancelled: Callable[[], bool]) -> Message:
        """Train one round of ``task``; ``cancelled`` turns true when its session is replaced."""
        started = time.perf_counter()
        weights = numpy_arrays(message)
        number = round_of(message)
        key, build = _segment_key(task), lambda: self._build_segment(task)
        stackable = task.mode != "backprop"
        with self.source.lease(key, build, weights, stackable) as lease:
            trainer = self._trainer(task, lease.segment)
            with self._peak() as peak:
                report = trainer.train_round(
                    number, seed=task.seed, step=lease.train_step, cancelled=cancelled
                )
            arrays = lease.state()
        self.rounds += 1
        log.info(
            "round %d: %d examples, loss %.4f, peak %s (estimate %s, budget %s)",
            number,
            report.examples,
            report.mean_loss,
            format_bytes(peak[0]) if peak[0] >= 0 else "not measured",
            format_bytes(task.estimated_peak_bytes),
            format_bytes(self.budget),
        )
        traffic = (
            report.bytes_sent + sum(a.nbytes for a in arrays.values()),
            report.bytes_received + sum(w.nbytes for w in weights.values()),
        )
        metrics = self._metrics(task, report, peak[0], traffic, started)
        content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
        return Message(content, reply_to=message)

    @contextmanager
    def _peak(self) -> Iterator[list[int]]:
        """The resident high-water mark above the start of the block (``[-1]`` when not
        measured: turned off, or not supported here), read when the block ends."""
        peak = [-1]
        meter = PeakMeter().start() if self.measure_peak and peak_supported() else None
        try:
            yield peak
        finally:
            if meter is not None:
                peak[0] = meter.peak()
                meter.close()

    def _metrics(
        self,
        task: Task,
        report: EdgeRoundReport,
        peak: int,
        traffic: tuple[int, int],
        started: float,
    ) -> MetricRecord:
        """The round's reply metrics; ``traffic``: all bytes sent and received."""
        return MetricRecord(
            {
                "num-examples": report.examples,
                "loss": report.mean_loss,
                "bytes-sent": traffic[0],
                "bytes-received": traffic[1],
                "cut-bytes-received": report.cut_bytes_received,
                "cut-bytes-sent": report.cut_bytes_sent,
                "peak-memory": peak,
                "estimated-peak": task.estimated_peak_bytes,
                "budget": self.budget,
                "credit-wait-seconds": report.credit_wait_seconds,
                "wall-seconds": time.perf_counter() - started,
            }
        )
