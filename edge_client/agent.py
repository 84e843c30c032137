"""The edge agent: a device that announces itself and trains whatever prefix a round assigns.

The agent keeps no assignment state: every ``train`` message carries its :class:`~wire.roles.Task`
(the run's model and training sections, the blocks), so an agent restarted mid-run serves the
next round it is sent. The sections are parsed once a message; a task that does not parse is
answered with an error naming the bad field. A task whose memory estimate exceeds the agent's
budget is refused with the reason; the coordinator asks first (a ``query`` message) and plans
around a refusal. Each round the agent measures the real peak memory of its training (resident
high-water mark above the level at the round's start) and reports it with the estimate.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edge_client.jobs import Job, with_job
from edge_client.source import OwnSegment, SegmentSource
from edge_client.trainer import (
    EdgeRoundReport,
    EdgeTrainer,
    EdgeTrainerConfig,
    send_done_after_failure,
)
from split_models.activations import activation_arrays
from split_models.config import ModelConfig, TrainingConfig
from split_models.cpu import process_cpu_share
from split_models.data import Dataset, model_data_problem, scale_warning, shaped_for
from split_models.errors import ConfigError, ModelError
from split_models.evaluation import (
    MAX_STATISTIC_SAMPLES,
    STATISTIC_BLOCKS,
    STATISTICS,
    batch_statistics,
    evaluate_weights,
)
from split_models.measure import PeakMeter, peak_supported
from split_models.sections import batch_norm_blocks, block_count
from split_models.segment import Segment
from split_models.timing import StepClock
from split_models.units import format_bytes
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.flow import CreditGate
from wire.flower import array_record, numpy_arrays, round_of
from wire.logs import warn
from wire.presence import PeerOffline, PresenceWatch
from wire.roles import Announcement, Task, go_online
from wire.session import RoundAbandoned, SessionWatch, left_unfinished
from wire.transport import Transport

__all__ = ["AssignmentRefused", "EdgeAgent", "statistics_reply"]

log = logging.getLogger(__name__)
_SERVERS_WAIT = 30.0  # seconds a failed round waits for its servers before saying so
_TIMED_STEPS, _TIMING_SECONDS = 16, 0.5  # an offered task's timing: at most, at least 3


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
    arrays = activation_arrays(result.output)
    envelope = Envelope("activations", "warm-up", "warm-up", 0, 0, {}, arrays)
    encode(envelope, encoding)


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
        models: Collection[str] = (),
        time_tasks: bool = False,
    ) -> None:
        """``budget``: the memory training may use now, when it is below what the device
        announced (other work on the device); assignments are checked against it.
        ``source``: where the agent gets built segments (a host running many agents shares
        one); by default the agent builds and keeps its own. ``models``: the import paths
        (``package.module:function``) it may build besides the zoo's models; a task naming
        any other is refused, so no message makes the agent import code. ``time_tasks``: time
        a few steps of each task it accepts and answer with the timing (a device whose
        speed was not declared; a simulation's profiles declare theirs)."""
        self.models, self.time_tasks = tuple(models), time_tasks
        if announcement.role != "edge":
            raise ValueError("an edge agent announces the role 'edge'")
        if announcement.examples is None:  # the planner spreads weight traffic over them
            announcement = dataclasses.replace(announcement, examples=len(data))
        self.announcement, self.data = announcement, data
        self._scale_said = False  # the data's scale looked over (at the first assignment)
        self.device = announcement.device
        self.budget = announcement.memory if budget is None else budget
        # The peak is the process's high-water mark: meaningful only with one agent a process
        # (simulation runs many agents in one process and turns it off).
        self.measure_peak = measure_peak
        self.channel = Channel(stream, self.device)
        self.sessions = SessionWatch(stream)
        self.presence = PresenceWatch(stream)  # a round's GPU server gone: give it up at once
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
    def check(self, task: Task, model: ModelConfig) -> None:
        """Raise :class:`AssignmentRefused` unless ``task`` of ``model`` fits this device and
        its data (the reason does not name the device: whoever shows it does)."""
        self.data = shaped_for(self.data, tuple(model.input_shape))  # [N, L] for a model of [L]
        if problem := model_data_problem(self.data, model, "local data", device=True):
            raise AssignmentRefused(problem)
        if not self._scale_said:  # the data is looked over once, not at every assignment
            self._scale_said = True
            if warning := scale_warning(self.data, "local data"):
                log.warning("%s", warning)
        if task.end > (blocks := block_count(model)):
            raise AssignmentRefused(
                f"blocks [{task.start}, {task.end}): {model.name} has {blocks} blocks"
            )
        if len(self.data) < 2 and (norms := batch_norm_blocks(model)):
            raise AssignmentRefused(  # BatchNorm in train mode needs 2 examples a batch
                f"the model's BatchNorm layers (in blocks {sorted(norms)}) cannot train on "
                f"{len(self.data)} example; give this device at least 2"
            )
        budget = self.budget
        if task.estimated_peak_bytes > budget:
            raise AssignmentRefused(
                f"blocks [{task.start}, {task.end}) need an estimated "
                f"{format_bytes(task.estimated_peak_bytes)}, the budget is {format_bytes(budget)}"
            )

    def _datasets(self, training: TrainingConfig) -> tuple[Dataset, Dataset | None]:
        """The data this agent trains on and, with federated evaluation
        (``training.federated_eval``), the share it holds out for evaluating the assembled
        model."""
        fraction = training.federated_eval
        if not 0 < fraction < 1 or len(self.data) < 2:
            return self.data, None
        key = (fraction, training.seed)
        if self._split is None or self._split[0] != key:
            self._split = (key, *self.data.split(fraction, seed=training.seed))
        return self._split[1], self._split[2]

    def _build_segment(self, job: Job) -> Segment:
        task, spec, training = job.task, job.model, job.training
        model = spec.build(seed=training.seed)
        segment = Segment.from_model(
            model, task.start, task.end, training.local_loss, training.optimizer
        )
        _warm_up(segment, self.data, training.compression)
        return segment

    def _trainer(self, job: Job, segment: Segment) -> EdgeTrainer:
        task, training = job.task, job.training
        # one trainer per task up to the estimate (a new session gets a fresh one)
        key = dataclasses.replace(task, estimated_peak_bytes=0).to_json()
        if self._built is None or self._built.key != key:
            config = self.trainer_config(job)
            train, _ = self._datasets(training)
            trainer = EdgeTrainer(self.channel, self._gate(task.run), segment, train, config)
            self._built = _Built(key, trainer)
        self._built.trainer.segment = segment
        return self._built.trainer

    def trainer_config(self, job: Job) -> EdgeTrainerConfig:
        """The trainer settings ``job``'s task and training section give this device."""
        task, training = job.task, job.training
        return EdgeTrainerConfig(
            task.run,
            self.device,
            task.segment,
            batch_size=training.batch_size,
            local_epochs=training.local_epochs,
            encoding=training.compression,
            credit_timeout=training.round_deadline_seconds,
            mode=training.mode,
        )

    # ---------------------------------------------------------------- Flower
    def client_app(self) -> ClientApp:
        app = ClientApp()
        app.query()(with_job(self._query, self.models))
        app.train()(with_job(self._round, self.models))
        app.evaluate()(with_job(self._evaluate, self.models))
        return app

    def _query(self, message: Message, job: Job) -> Message:
        """Whether this device takes ``job`` (accepted, or refused with the reason)."""
        try:
            self.check(job.task, job.model)
            accepted, reason = 1, ""
        except AssignmentRefused as refusal:
            accepted, reason = 0, str(refusal)
            log.warning("%s refused an assignment: %s", self.device, refusal)
        timed = self._time_task(job) if accepted and self.time_tasks else {}
        content = RecordDict(
            {
                "metrics": MetricRecord({"accepted": accepted, "budget": self.budget, **timed}),
                "answer": ConfigRecord({"reason": reason}),
            }
        )
        return Message(content, reply_to=message)

    def _time_task(self, job: Job) -> dict[str, float | list[int]]:
        """A few training steps of the offered blocks on this device's data, timed as a
        round's are (:class:`~split_models.timing.StepClock`): the coordinator plans with
        the speed they measure, not the announced one. Backprop mode is timed in rounds."""
        data, _ = self._datasets(job.training)
        if job.training.mode == "backprop" or not len(data):
            return {}
        segment = self._build_segment(job)
        clock = StepClock(share=process_cpu_share(torch.get_num_threads()))
        batch = min(job.training.batch_size, len(data))
        started = time.perf_counter()
        for step in range(_TIMED_STEPS):
            rows = (np.arange(batch) + step * batch) % len(data)
            inputs, labels = torch.from_numpy(data.x[rows]), torch.from_numpy(data.y[rows])
            began = clock.start()
            segment.train_step(inputs, labels)
            clock.add(began, {job.task.end: batch})
            if step >= 2 and time.perf_counter() - started > _TIMING_SECONDS:
                break
        return clock.metrics()

    def _round(self, message: Message, job: Job) -> Message:
        task, handed, work = job.task, [False], (round_of(message), job.attempt)
        try:
            self.check(task, job.model)
            replaced = self.sessions.follow(task.run, task.session, work)
            return self._train(message, job, lambda: self.node.leaving or replaced(), handed)
        except (RoundAbandoned, PeerOffline) as raised:
            abandoned = self.sessions.explained(raised, task.run, task.session, work)
            if self.node.leaving:  # stopped (SIGTERM, Ctrl-C): its leaving ended the try
                why = left_unfinished(round_of(message), f"edge {self.device}")
                log.info("%s", why)
                return Message(Error(code=2, reason=why), reply_to=message)
            # a host of many simulated clients: a few lines
            warn(log, "abandoned", "%s: %s", self.device, abandoned)
            return Message(Error(code=2, reason=str(abandoned)), reply_to=message)
        except Exception as error:
            if not handed[0]:  # the trainer's own give-up covers a failure mid-round
                self._nothing_sent(task, round_of(message), job.attempt)
            if not isinstance(error, AssignmentRefused | ModelError):
                raise
            # its own decision, or weights that do not fit the blocks: one line, not a
            # traceback, and the reason to the coordinator
            warn(log, "refused", "%s refused round %d: %s", self.device, round_of(message), error)
            reason = f"{type(error).__name__}: {error}"
            return Message(Error(code=1, reason=reason), reply_to=message)

    def _nothing_sent(self, task: Task, number: int, attempt: int) -> None:
        """The round failed before training (its blocks refused, the segment could not be
        built): tell the GPU servers this try sends nothing, so they do not wait for it until
        the round's deadline (the error goes to the coordinator in the reply). Sent once a
        server grants this try's first credit (it serves the round then: a message before
        that finds no one), or after ``_SERVERS_WAIT`` seconds without one."""
        gate = self._gate(task.run)
        gate.start_round(number, attempt)
        gate.acquire(_SERVERS_WAIT)
        send_done_after_failure(self.channel, task.run, self.device, number, attempt)

    def _evaluate(self, message: Message, job: Job) -> Message:
        """The assembled model's accuracy on the held-out share (none: zero examples); asked
        for its BatchNorm statistics instead (``norm: recalibrate``), those on the training
        share."""
        if STATISTICS in message.content.config_records["config"]:
            return self._statistics(message, job)
        _, held_out = self._datasets(job.training)
        if held_out is None:
            result, count = {"accuracy": 0.0, "loss": 0.0}, 0
        else:
            weights = numpy_arrays(message)
            spec = job.model
            with self.source.slot():  # on a shared host, bounded as training is
                result = evaluate_weights(spec, weights, held_out, 64)
            count = len(held_out)
        metrics = MetricRecord({"num-examples": count, **result})
        return Message(RecordDict({"metrics": metrics}), reply_to=message)

    def _statistics(self, message: Message, job: Job) -> Message:
        """The assembled model's BatchNorm statistics on this device's training share."""
        train, _ = self._datasets(job.training)
        with self.source.slot():  # on a shared host, bounded as training is
            return statistics_reply(message, job.model, train, job.training.seed)

    def _train(
        self, message: Message, job: Job, cancelled: Callable[[], bool], handed: list[bool]
    ) -> Message:
        """Train one round of ``job``; ``cancelled`` turns true when its session is replaced;
        ``handed[0]`` turns true once its trainer takes over (and answers for failures)."""
        started = time.perf_counter()
        task, seed = job.task, job.training.seed
        since = time.monotonic()  # a GPU server restarted after this lost the round
        weights = numpy_arrays(message)
        number = round_of(message)
        key, build = task.segment_key(), lambda: self._build_segment(job)
        # stacked steps group clients by timing, which a deterministic run must not depend on
        stackable = job.training.mode != "backprop" and not job.training.deterministic
        ordered = job.training.deterministic
        leased = self.source.lease(
            key, build, weights, stackable, job.proximal_mu, self.device, ordered=ordered
        )
        with leased as lease:
            lease.segment.lr_scale = job.training.lr_scale(number)
            lease.segment.step_bound = job.max_step
            trainer = self._trainer(job, lease.segment)
            handed[0] = True
            with self._peak() as peak:
                report = trainer.train_round(
                    number,
                    seed=seed,
                    step=lease.train_step,
                    pace=lease.pace,
                    cancelled=cancelled,
                    attempt=(job.attempt, job.order),
                    offline=lambda: self.presence.offline(task.servers, since),
                )
            arrays = lease.state()
        self.rounds += 1
        self.log_round(number, report, peak[0], task.estimated_peak_bytes)
        traffic = (
            report.bytes_sent + sum(a.nbytes for a in arrays.values()),
            report.bytes_received + sum(w.nbytes for w in weights.values()),
        )
        metrics = self._metrics(task, report, peak[0], traffic, started)
        content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
        return Message(content, reply_to=message)

    def log_round(self, number: int, report: EdgeRoundReport, peak: int, estimate: int) -> None:
        """The round's line; a warning when the measured peak went over the budget (the
        estimate fell short on this device: the operator may lower the batch or the cut)."""
        loss = "no local loss" if math.isnan(report.mean_loss) else f"loss {report.mean_loss:.4f}"
        estimated, budget = format_bytes(estimate), format_bytes(self.budget)
        if peak > self.budget:
            log.warning(
                "round %d: the measured peak %s went over the budget %s (estimated %s): "
                "this device may run out of memory; give it a smaller batch or a shorter segment",
                number,
                format_bytes(peak),
                budget,
                estimated,
            )
        log.info(
            "round %d: %d examples, %s, peak %s (estimate %s, budget %s)",
            number,
            report.examples,
            loss,
            format_bytes(peak) if peak >= 0 else "not measured",
            estimated,
            budget,
        )

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
                **report.compute,
            }
        )


def statistics_reply(message: Message, spec: ModelConfig, data: Dataset, seed: int) -> Message:
    """The reply to a ``norm: recalibrate`` request: the BatchNorm statistics of the blocks
    the coordinator names, measured on up to the samples it asks for of ``data`` (drawn with
    ``seed`` and the round). The request is checked as any message from the network is."""
    asked = message.content.config_records["config"]
    samples, end = asked.get(STATISTICS), asked.get(STATISTIC_BLOCKS)
    if not isinstance(samples, int) or not 1 < samples <= MAX_STATISTIC_SAMPLES:
        raise ConfigError(
            f"asked for BatchNorm statistics over {samples!r} samples; expected 2 to "
            f"{MAX_STATISTIC_SAMPLES}"
        )
    if not isinstance(end, int):
        raise ConfigError(f"asked for BatchNorm statistics of blocks [0, {end!r})")
    drawn = seed * 100_003 + round_of(message)
    stats, count = batch_statistics(spec, numpy_arrays(message), data, samples, drawn, end)
    content = RecordDict(
        {"arrays": array_record(stats), "metrics": MetricRecord({"num-examples": count})}
    )
    return Message(content, reply_to=message)
