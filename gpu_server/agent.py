"""The GPU server agent: hosts the back blocks a round assigns and trains them on the edges'
activation streams.

Like the edge agent it keeps no assignment state: each ``train`` message's
:class:`~wire.roles.Task` carries the run's model and training sections (parsed once a message;
a bad one is answered with an error naming the field), the blocks this server holds and the
edges whose streams the round trains. The server answers before the round's deadline with
whatever it trained, and names the edges whose batches all arrived, so the coordinator can tell
a late edge from a finished one. An edge whose last will arrives mid-round (presence
``offline``) ends its part at once: the server stops waiting for it, keeps what of it arrived
(all in) and names it ``gone``. Several servers take one shared subscription and split the stream.
A sender that said what it sent but whose batches do not add up, with nothing more arriving for
:data:`GAP_QUIET_SECONDS` (a restarted broker lost some), is named ``missing``: the coordinator
redoes the round rather than commit it short. Each round the server logs, per sender, what it
trained (``batches-trained``, docs/wire.md "Counting").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gpu_server.trainer import BackTrainer
from split_models.config import ModelConfig, TrainingConfig
from split_models.errors import ConfigError, ModelError
from split_models.randomness import RandomStream, stream_seed
from split_models.sections import task_sections
from wire.channel import Channel
from wire.errors import WireError
from wire.flower import (
    TRAINED_RECORD,
    array_record,
    attempt_of,
    numpy_arrays,
    order_of,
    proximal_mu_of,
    round_of,
)
from wire.presence import PresenceWatch
from wire.roles import Announcement, Task, go_online
from wire.session import RoundAbandoned, SessionWatch, left_unfinished
from wire.transport import Transport

__all__ = ["GAP_QUIET_SECONDS", "GpuAgent", "server_wait_seconds"]

log = logging.getLogger(__name__)
# How long a sender that said what it sent may go without a batch arriving before the server
# counts the rest as lost (a stream runs at several batches a second; QoS 1 redelivery after a
# reconnect comes within a second or two of the link).
GAP_QUIET_SECONDS = 3.0


def server_wait_seconds(deadline: float) -> float:
    """How long a server waits for the round's edges to finish (their batches all handled, by
    the counts they declare): long enough for a slow edge, and short enough that its reply
    reaches the coordinator before the round's deadline."""
    return max(0.5 * deadline, deadline - max(5.0, 0.1 * deadline))


class GpuAgent:
    """Serves Flower ``train`` messages for the back segment of each round."""

    def __init__(
        self,
        announcement: Announcement,
        control: Transport,
        stream: Transport,
        models: Collection[str] = (),
    ) -> None:
        """``models``: the import paths it may build besides the zoo's models (a task naming
        any other is refused: no message makes the server import code)."""
        self.models = tuple(models)
        if announcement.role != "gpu":
            raise ValueError("a GPU server agent announces the role 'gpu'")
        self.announcement = announcement
        self.device = announcement.device
        self.stream = stream
        self.sessions = SessionWatch(stream)
        self.presence = PresenceWatch(stream)  # a sender gone offline ends its part at once
        # run -> (the task's segment key and stream wiring, trainer)
        self._backs: dict[str, tuple[str, BackTrainer]] = {}
        self.node = go_online(announcement, control, self.client_app())

    def back(self, task: Task, sections: tuple[ModelConfig, TrainingConfig]) -> BackTrainer:
        """The trainer for ``task``'s run, rebuilt when its segment (``Task.segment_key``) or
        its stream (the one it serves, its encoding) change."""
        spec, training = sections
        # segment_key() already says whether the piece passes its output on, and the
        # coordinator names the next piece's stream after this one's (seg-<k> -> seg-<k+1>)
        key = f"{task.segment_key()}|{[task.segment, training.compression]}"
        key += f"|{training.deterministic}|{training.server_fill}"
        known = self._backs.get(task.run)
        if known is None or known[0] != key:
            if known is not None:  # re-planned: the old piece leaves its streams first (the
                known[1].close()  # new one may subscribe to the same filters)
            model = spec.build(seed=training.seed)
            trainer = BackTrainer(
                Channel(self.stream, self.device),
                model,
                start=task.start,
                run=task.run,
                segment=task.segment,
                optimizer=training.server_optimizer(),
                device=self.announcement.accelerator,
                end=task.end,
                local_loss=training.local_loss,
                forward=task.forward,
                encoding=training.compression,
                ordered=training.deterministic,
                max_activation=training.max_activation,
                fill=training.batch_size
                if training.server_fill and training.mode != "backprop"
                else 0,
                max_rows=training.batch_size,
            )
            self._backs[task.run] = (key, trainer)
        return self._backs[task.run][1]

    def stop(self) -> None:
        """Leave for good (SIGTERM, Ctrl-C): a round in progress ends now, and the server
        takes no share of any stream before it says it is offline, so the try the coordinator
        starts on hearing it goes whole to the servers left."""
        self.node.leaving = True  # the rounds' waits ask it
        for _, back in list(self._backs.values()):
            back.part()
        self.node.leave()

    def trainer(self, run: str) -> BackTrainer | None:
        """The trainer serving ``run`` now, if a round of it was sent to this server."""
        known = self._backs.get(run)
        return None if known is None else known[1]

    def client_app(self) -> ClientApp:
        app = ClientApp()

        @app.train()
        def train(message: Message, _context: Context) -> Message:
            try:
                task = Task.parse(str(message.content.config_records["config"]["task"]))
                sections = task_sections(task.model, task.training, self.models)
                mu, attempt = proximal_mu_of(message), attempt_of(message)
                order_of(message)  # validated here: _round draws its dropout masks by it
            except (WireError, ConfigError) as error:
                log.warning("rejected a task: %s", error)
                return Message(Error(code=3, reason=f"bad task: {error}"), reply_to=message)
            try:
                return self._round(message, task, sections, (mu, attempt))
            except ModelError as error:  # weights that do not fit the blocks: one line
                log.warning("refused round %d: %s", round_of(message), error)
                return Message(Error(code=1, reason=f"ModelError: {error}"), reply_to=message)

        return app

    def _offline(
        self, task: Task, peers: list[str], work: tuple[int, int]
    ) -> Callable[[], list[str]]:
        """The round's senders to stop waiting for: those offline or out of ``work`` (round,
        try: the coordinator has their error reply), or every one when a peer sharing the
        stream went offline (the batches it held are lost, and the edges it gave credits give
        the round up). A sender restarted since is offline for this round."""
        since, senders = time.monotonic(), set(task.edges)

        def offline() -> list[str]:
            if self.presence.offline(peers, since):
                return list(task.edges)
            out = self.sessions.out(task.run, task.session, work) & senders
            return sorted(out.union(self.presence.offline(task.edges, since)))

        return offline

    def _stream(self, message: Message, task: Task, training: TrainingConfig) -> RandomStream:
        """Where the round's dropout masks come from: seeded by the run, this server, its
        piece, the round and the try's batch order (a redone try draws what it replaces)."""
        order = order_of(message)
        seed = stream_seed(training.seed, self.device, task.start, round_of(message), order)
        return RandomStream(seed)

    def _round(
        self,
        message: Message,
        task: Task,
        sections: tuple[ModelConfig, TrainingConfig],
        options: tuple[float, int] = (0.0, 1),
    ) -> Message:
        """Train one round of ``task`` on its edges' streams and reply before the deadline
        (``options``: FedProx's proximal weight and the coordinator's try of the round)."""
        started = time.perf_counter()
        back = self.back(task, sections)
        weights, number = numpy_arrays(message), round_of(message)
        peers = [s for s in task.servers if s != self.device]
        follow = self.sessions.follow(task.run, task.session, work := (number, options[1]))

        def cancelled() -> bool:  # the try was replaced, or this server is stopping
            return self.node.leaving or follow()

        before = _traffic(back)
        scale, random = sections[1].lr_scale(number), self._stream(message, task, sections[1])
        back.begin_round(number, task.edges, weights, peers, *options, scale, random)
        wait = server_wait_seconds(sections[1].round_deadline_seconds)
        offline = self._offline(task, peers, work)
        examples, loss = back.wait_round(task.edges, wait, cancelled, offline, GAP_QUIET_SECONDS)
        _log_batches(back, task.run, work, self.device)
        back.part()  # left out of the next plan, it must not take a share of this stream
        if cancelled():
            why = self.sessions.why(task.run, task.session, work)
            return _abandoned(message, number, self.device, self.node.leaving, why)
        arrays = back.state()
        trained: dict[str, Any] = back.round_senders()
        metrics = MetricRecord(
            {
                "num-examples": examples,
                "loss": loss,
                **_counted(before, _traffic(back), weights, arrays),
                "wall-seconds": time.perf_counter() - started,
                **back.timing(),
            }
        )
        content = RecordDict(
            {
                "arrays": array_record(arrays),
                "metrics": metrics,
                "report": _report(back, task.edges, number),
                # what the coordinator bounds each edge's claimed examples by
                TRAINED_RECORD: ConfigRecord(trained),
            }
        )
        return Message(content, reply_to=message)


def _traffic(back: BackTrainer) -> tuple[int, int, int, int]:
    """The bytes ``back``'s stream has sent and received so far, and of those the cut's
    (activations and gradients, either way)."""
    stats = back.stream.channel.stats
    sent, received = stats.sent_by_kind, stats.received_by_kind
    cut = ("activations", "gradients")
    return (
        stats.bytes_sent,
        stats.bytes_received,
        sum(sent[k] for k in cut),
        sum(received[k] for k in cut),
    )


def _counted(
    before: tuple[int, ...],
    after: tuple[int, ...],
    weights: Mapping[str, np.ndarray],
    arrays: Mapping[str, np.ndarray],
) -> dict[str, int]:
    """A round's traffic, as an edge reports its own: the weights down and up, and what the
    stream carried meanwhile (the edges' activations in, credits and splitfed's gradients
    out, a chained piece's forwarding), with the cut's bytes apart."""
    sent, received, cut_sent, cut_received = (a - b for a, b in zip(after, before, strict=True))
    return {
        "bytes-received": sum(w.nbytes for w in weights.values()) + received,
        "bytes-sent": sum(a.nbytes for a in arrays.values()) + sent,
        "cut-bytes-received": cut_received,
        "cut-bytes-sent": cut_sent,
    }


def _abandoned(
    message: Message, number: int, device: str, leaving: bool, why: str | None = None
) -> Message:
    """The error reply of a round cut short: by this server stopping (SIGTERM, Ctrl-C: its
    leaving made the coordinator move on), or by the coordinator replacing the try (``why``:
    with what, :meth:`~wire.session.SessionWatch.why`)."""
    if leaving:
        reason = left_unfinished(number, f"GPU server {device}")
        log.info("%s", reason)
    else:
        reason = str(RoundAbandoned(number, why))
        log.warning("%s", reason)
    return Message(Error(code=2, reason=reason), reply_to=message)


def _log_batches(back: BackTrainer, run: str, work: tuple[int, int], server: str) -> None:
    """One parseable line per sender: the batches trained in this try and how many of them
    were distinct (docs/wire.md, "Counting")."""
    for sender, (trained, distinct) in sorted(back.round_batches().items()):
        log.info(
            "batches-trained run=%s round=%d try=%d server=%s sender=%s batches=%d distinct=%d",
            run,
            *work,
            server,
            sender,
            trained,
            distinct,
        )


def _report(back: BackTrainer, edges: Collection[str], number: int) -> ConfigRecord:
    """Which senders finished, which went offline mid-round (``gone``: what of them arrived
    is trained, all in), which miss batches they said they sent (``missing``: lost on the
    way, the round must be redone) and which were late."""
    finished, gone = sorted(back.finished), sorted(back.gone - back.finished)
    lost = back.missing(GAP_QUIET_SECONDS)
    missing = sorted(set(lost) - set(finished) - set(gone))
    late = sorted(set(edges) - set(finished) - set(gone) - set(missing))
    if late:
        log.warning("round %d: %s not finished before the deadline", number, late)
    if missing:
        log.warning("round %d: batches lost on the way: %s", number, lost)
    return ConfigRecord(
        {
            "finished": ",".join(finished),
            "late": ",".join(late),
            "gone": ",".join(gone),
            "missing": ",".join(missing),
        }
    )
