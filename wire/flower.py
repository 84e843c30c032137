"""Flower's Message API over an edgesplit transport.

``TransportGrid`` is a ``flwr.serverapp.Grid``: any Flower strategy (FedAvg, FedProx, FedAdam,
FedTrimmedAvg, Krum...) drives rounds through it unchanged. ``FlowerNode`` runs on a device and
hands each message to a Flower ``ClientApp``. Messages travel as Flower's own protobuf
serialisation, in chunk frames (so large models pass the broker's packet limit), and every
inbound payload is size-bounded, hash-checked and parsed defensively.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from wire import topics
from wire.arrays import array_numpy, array_record, numpy_array, numpy_arrays
from wire.chunks import Reassembler, split
from wire.errors import WireError
from wire.logs import warn
from wire.presence import incarnation_of, new_incarnation
from wire.recent import recent_entry
from wire.transport import Transport, Will

__all__ = [
    "TRAINED_RECORD",
    "FlowerNode",
    "TransportGrid",
    "array_numpy",
    "array_record",
    "attempt_of",
    "max_step_of",
    "node_will",
    "numpy_array",
    "numpy_arrays",
    "order_of",
    "proximal_mu_of",
    "round_of",
]

log = logging.getLogger(__name__)
CHUNK_BYTES = 32 * 1024 * 1024
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
_NODES = f"{topics.PREFIX}/presence"  # a device's presence is its node's
# A GPU server's train reply: examples it trained this round, by sender (name -> count)
TRAINED_RECORD = "trained"


def round_of(message: Message) -> int:
    """The run's round number of a ``train`` message: Flower's ``server-round`` plus the
    ``round-offset`` a resumed coordinator sends (rounds it had committed before)."""
    config = message.content.config_records["config"]
    return int(config["server-round"]) + int(config.get("round-offset", 0))  # type: ignore[arg-type]


def attempt_of(message: Message) -> int:
    """Which try of its round a ``train`` message is (1 unless the coordinator retried it);
    a value that is not an integer in ``[1, 999]`` raises :class:`WireError`."""
    value = message.content.config_records["config"].get("attempt", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1000:
        raise WireError("config", f"attempt must be an integer in [1, 999], got {value!r}")
    return value


def order_of(message: Message) -> int:
    """Which batch order a ``train`` message's try draws (``order``: 1 plus the coordinator's
    failed tries of the round before it; the try's number when absent). A try redone after
    the coordinator restarted or lost the broker keeps its order, so a resumed run trains as
    an uninterrupted one; a value that is not an integer in ``[1, 999]`` raises
    :class:`WireError`."""
    config = message.content.config_records["config"]
    value = config.get("order", config.get("attempt", 1))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1000:
        raise WireError("config", f"order must be an integer in [1, 999], got {value!r}")
    return value


def proximal_mu_of(message: Message) -> float:
    """FedProx's proximal weight in a ``train`` message's config (``proximal-mu``, which the
    ``fedprox`` strategy's ``configure_train`` puts there); 0 without one. A value that is
    not a finite number in ``[0, 1e6]`` raises :class:`WireError`."""
    value = message.content.config_records["config"].get("proximal-mu", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError("config", f"proximal-mu must be a number, got {value!r}")
    if not 0 <= value <= 1e6:  # NaN fails both comparisons
        raise WireError("config", f"proximal-mu must be in [0, 1e6], got {value!r}")
    return float(value)


def max_step_of(message: Message) -> float | None:
    """A bound on each training step of a ``train`` message's round (``max-step``, as
    ``optimizer.max_step``; the coordinator sets it for an edge's first round at a new cut);
    None without one. A value that is not a number in ``(0, 1e3]`` raises
    :class:`WireError`."""
    value = message.content.config_records["config"].get("max-step")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1e3:
        raise WireError("config", f"max-step must be a number in (0, 1000], got {value!r}")
    return float(value)


def node_will(node_id: int, name: str | None = None) -> Will:
    """The last will a node's transport must carry, so the grid sees it go offline."""
    return Will(f"{_NODES}/{_node_name(node_id, name)}", b"offline")


def _node_name(node_id: int, name: str | None) -> str:
    return topics.check_name(name if name is not None else str(int(node_id)), "node")


def node_id_of(name: str) -> int:
    """The Flower node id of the node named ``name``: the number itself for a numbered node
    (``"7"``), else ``wire.roles.node_id_for(name)``. The grid derives it from the topic a
    node announces itself on, never from what the announcement says."""
    from wire.roles import node_id_for

    return int(name) if name.isdigit() else node_id_for(name)


_SOURCES = 1024  # senders whose incomplete messages a receiver keeps apart


class _Frames:
    """Serialise Flower messages into chunk frames and back, with validation."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.chunk_bytes = min(CHUNK_BYTES, transport.max_payload - 512)
        # one reassembler per topic a message arrives on (per sender, under the ACL): what
        # one sender leaves incomplete cannot crowd out another's messages
        self._reassemblers: collections.OrderedDict[str, Reassembler] = collections.OrderedDict()
        self.rejected = 0
        self._lock = threading.Lock()

    def _reassembler(self, source: str) -> Reassembler:
        return recent_entry(self._reassemblers, source, self._new_reassembler, _SOURCES)

    @staticmethod
    def _new_reassembler() -> Reassembler:
        return Reassembler(MAX_MESSAGE_BYTES)

    def send(self, topic: str, message: Message) -> None:
        data = message_to_proto(message).SerializeToString()
        for frame in split(data, self.chunk_bytes):
            self.transport.publish(topic, frame)

    def receive(self, payload: bytes, source: str = "") -> Message | None:
        """The Flower message ``payload`` completes (None while incomplete or when invalid);
        ``source``: the topic it came on."""
        try:
            with self._lock:
                whole = self._reassembler(source).feed(payload)
            if whole is None:
                return None
            proto = ProtoMessage()
            proto.ParseFromString(whole)
            return message_from_proto(proto)
        except WireError as error:
            self.rejected += 1
            warn(log, (source, "frame"), "rejected Flower frame on %s: %s", source, error)
        except Exception as error:  # protobuf and Flower raise assorted types on bad input
            self.rejected += 1
            warn(log, (source, "message"), "rejected Flower message on %s: %s", source, error)
        return None


class TransportGrid(Grid):
    """The coordinator's side: sends Flower messages to nodes and collects their replies."""

    def __init__(self, transport: Transport, run_id: int = 1) -> None:
        self.transport = transport  # its link tells the runner of a broker outage
        self._frames = _Frames(transport)
        self._run = Run.create_empty(run_id)
        self._replies: dict[str, Message] = {}
        # message id -> the name of the node it went to and the message, until answered
        self._sent: dict[str, tuple[str, Message]] = {}
        self._incarnations: dict[int, str] = {}  # node id -> the process last seen online
        self._online: set[int] = set()
        self._names: dict[int, str] = {}  # node id -> the name its topics carry
        self._condition = threading.Condition()
        # told (node name, the train message) when a node answers a train message with an
        # error: the coordinator tells the GPU servers to stop waiting for that node's stream
        self.on_train_error: Callable[[str, Message], None] | None = None
        # Flower's own runtime sets this process-wide identity; here the grid is the runtime.
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        TaskIdentity.task_id = run_id
        transport.subscribe(topics.flower_out_filter(), self._on_reply)
        transport.subscribe(f"{_NODES}/+", self._on_presence)

    def _on_reply(self, topic: str, payload: bytes) -> None:
        """A reply on ``flower/<name>/out``: kept only when it answers a message sent to
        that node (a device cannot answer for another: the topic is its account's), and
        stamped with that node's id as its sender."""
        sender = topic.split("/")[-2]
        message = self._frames.receive(payload, topic)
        if message is None:
            return
        reply_to = message.metadata.reply_to_message_id
        with self._condition:
            addressee, sent = self._sent.get(reply_to, (None, None))
            # late: a try given up, or a coordinator before this one
            if addressee is None or sent is None:
                warn(
                    log,
                    (sender, "unknown"),
                    "dropped a Flower reply of %r to message %r: not awaited (given up, or sent "
                    "before this coordinator started)",
                    sender,
                    reply_to,
                    level=logging.INFO,
                )
                return
            if addressee != sender:
                log.warning(
                    "dropped a Flower reply from %r to a message sent to %r", sender, addressee
                )
                return
            del self._sent[reply_to]
            # its sender is the node the topic names, whatever the reply says (a device must
            # not pass for another, e.g. for a trusted GPU server, to whoever reads the reply)
            message.metadata.__dict__["_src_node_id"] = node_id_of(sender)
            self._replies[reply_to] = message
            self._condition.notify_all()
        told = self.on_train_error
        if told is not None and message.has_error() and sent.metadata.message_type == "train":
            told(sender, sent)

    def _on_presence(self, topic: str, payload: bytes) -> None:
        """Retained ``online <node id> <incarnation>`` or ``offline`` on
        ``edgesplit/v1/presence/<name>``. A node online under a new incarnation restarted: the
        messages its old process had are answered with an error at once."""
        name = topic.rsplit("/", 1)[1]
        state, _, rest = payload.decode("ascii", "replace").partition(" ")
        number = rest.partition(" ")[0]
        try:
            node_id = node_id_of(name)
        except ValueError:
            warn(log, ("presence", name), "ignored the presence of a node named %r", name)
            return
        with self._condition:
            if state == "online" and number.isdigit():
                # the id is the name's, whatever a node says (compared as text: int() of a
                # 5,000-digit number raises)
                if number != str(node_id):
                    log.warning(
                        "ignored %r announcing node %.24s: its node id is %s",
                        name,
                        number,
                        node_id,
                    )
                    return
                if (known := self._names.get(node_id, name)) != name:
                    warn(
                        log,
                        ("same id", name),
                        "ignored %r: its node id %s is %r's, which came online first; "
                        "rename one of them",
                        name,
                        node_id,
                        known,
                    )
                    return
                self._names[node_id] = name
                self._online.add(node_id)
                self._incarnation(node_id, name, incarnation_of(payload))
            elif self._names.get(node_id, name) == name:  # not another's id going offline
                self._online.discard(node_id)
            self._condition.notify_all()

    def _incarnation(self, node_id: int, name: str, incarnation: str) -> None:
        """Called with the condition held: a new ``incarnation`` of ``name`` ends the messages
        its previous process was given (it died with them)."""
        known = self._incarnations.get(node_id)
        if incarnation:
            self._incarnations[node_id] = incarnation
        if not incarnation or known in (None, incarnation):
            return
        lost = [i for i, (addressee, _) in self._sent.items() if addressee == name]
        for identifier in lost:
            _, message = self._sent.pop(identifier)
            reason = f"{name} restarted (a new process came online): the message died with the old"
            self._replies[identifier] = Message(Error(code=4, reason=reason), reply_to=message)
        if lost:
            log.warning("%s restarted: %d message(s) to it count as failed", name, len(lost))

    def wait_for_nodes(self, count: int, timeout: float) -> list[int]:
        """Block until ``count`` nodes are online (or the timeout passes); return them."""
        deadline = time.monotonic() + timeout
        with self._condition:
            while len(self._online) < count and time.monotonic() < deadline:
                self._condition.wait(0.05)
            return sorted(self._online)

    def set_run(self, run: Run) -> None:
        self._run = run
        TaskIdentity.run_id = run.run_id

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        with self._condition:
            return sorted(self._online)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        identifiers = []
        for message in messages:
            identifier = str(uuid.uuid4())
            message.metadata.__dict__["_message_id"] = identifier
            node = message.metadata.dst_node_id
            with self._condition:
                name = self._names.get(node)
                if name is not None:
                    self._sent[identifier] = (name, message)
            if name is None:
                raise ValueError(f"node {node} never announced itself; it cannot be reached")
            self._frames.send(topics.flower_in(name), message)
            identifiers.append(identifier)
        return identifiers

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._condition:
            return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def abandon(self, message_ids: Iterable[str]) -> None:
        """Stop waiting for replies to ``message_ids``; late replies to them are dropped."""
        with self._condition:
            for identifier in message_ids:
                self._sent.pop(identifier, None)
                self._replies.pop(identifier, None)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            with self._condition:
                ready = [i for i in pending if i in self._replies]
                if not ready:
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    self._condition.wait(0.05)
                    continue
            got = list(self.pull_messages(ready))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
        with self._condition:
            for identifier in pending:  # late replies to abandoned messages are dropped
                self._sent.pop(identifier, None)
        # Arrival order depends on the network; a fixed order makes aggregation reproducible.
        return sorted(replies, key=lambda m: m.metadata.src_node_id)


_SEEN_MESSAGES = 4096  # message ids a node remembers, to drop repeats
# An offline said of a node this soon after it reconnected is its own will, published when the
# connection dropped (a broker stopped cleanly publishes every client's): no warning then
_WILL_AFTER_RECONNECT = 60.0


class FlowerNode:
    """A device's side: runs a Flower ``ClientApp`` on every message addressed to it. Create
    its transport with ``will=node_will(node_id, name)`` so the grid sees a crash."""

    def __init__(
        self,
        transport: Transport,
        node_id: int,
        app: ClientApp,
        node_config: dict[str, Any] | None = None,
        run_id: int = 1,
        name: str | None = None,
    ) -> None:
        self.transport, self.node_id, self.app = transport, int(node_id), app
        self.name = _node_name(node_id, name)
        if node_id_of(self.name) != self.node_id:
            raise ValueError(
                f"node {self.name!r} has node id {node_id_of(self.name)}, not {node_id}: the "
                "coordinator derives a node's id from its name"
            )
        self._frames = _Frames(transport)
        self.incarnation = new_incarnation()  # this process's, the same on every reconnect
        self._context = Context(
            run_id=run_id,
            node_id=self.node_id,
            node_config=dict(node_config or {}),
            state=RecordDict(),
            run_config={},
        )
        self.handled = 0
        self.leaving = False  # :meth:`leave` was called: work cut short now is this node's doing
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._seen_lock = threading.Lock()
        TaskIdentity.run_id = run_id
        transport.subscribe(topics.flower_in(self.name), self._on_message)
        self._announce()
        # a restarted broker without persistence forgets retained messages: say it again
        transport.on_reconnect(self._announce)
        self._contradicted = -math.inf  # when an offline was last answered (monotonic)
        transport.subscribe(f"{_NODES}/{self.name}", self._on_own_presence)

    def _announce(self) -> None:
        self.transport.publish(
            f"{_NODES}/{self.name}",
            f"online {self.node_id} {self.incarnation}".encode(),
            retain=True,
        )

    def _on_own_presence(self, topic: str, payload: bytes) -> None:
        """``offline`` said of this node while it runs (a will delivered after it reconnected,
        or a message another broker client wrote): say ``online`` again at once, so the
        offline counts for nothing (:class:`~wire.presence.WillGrace`: an offline counts only
        when no online follows it within the grace). Once a second at most."""
        if self.leaving or payload.strip() != b"offline":
            return
        now = time.monotonic()
        if now - self._contradicted < 1.0:
            return
        self._contradicted = now
        back = getattr(self.transport, "last_reconnect", None)
        if back is not None and now - back < _WILL_AFTER_RECONNECT:  # its own will
            log.info("node %s: its will came after it reconnected; online again", self.name)
        else:
            warn(
                log,
                ("contradicted", self.name),
                "node %s: its presence said offline while it runs (a late last will, or "
                "another broker client wrote it: check which accounts may write %s); said "
                "online again",
                self.name,
                topic,
            )
        self._announce()

    def _on_message(self, topic: str, payload: bytes) -> None:
        message = self._frames.receive(payload, topic)
        if message is None:
            return
        if message.metadata.dst_node_id != self.node_id:
            log.warning(
                "node %s dropped a message for node %s", self.node_id, message.metadata.dst_node_id
            )
            return
        identifier = message.metadata.message_id
        with self._seen_lock:
            repeated = identifier in self._seen
            self._seen[identifier] = None
            if len(self._seen) > _SEEN_MESSAGES:
                self._seen.popitem(last=False)
        if repeated:  # a redelivery or a replay: a round is not trained twice
            warn(log, "repeated", "node %s dropped a repeated message %r", self.node_id, identifier)
            return
        try:
            reply = self.app(message, self._context)
        except Exception as error:  # the ClientApp failed: tell the strategy, keep running
            if isinstance(error, WireError):  # a refusal that says what went wrong
                log.warning("ClientApp failed on node %s: %s", self.node_id, error)
            else:
                log.exception("ClientApp failed on node %s", self.node_id)
            reply = Message(
                Error(code=1, reason=f"{type(error).__name__}: {error}"), reply_to=message
            )
        self.handled += 1
        self._frames.send(topics.flower_out(self.name), reply)

    def leave(self) -> None:
        """Announce a clean departure (retained ``offline``)."""
        self.leaving = True
        self.transport.publish(f"{_NODES}/{self.name}", b"offline", retain=True)
