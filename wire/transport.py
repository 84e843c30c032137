"""The transport seam: publish bytes to a topic, subscribe a handler to a topic filter.

Two implementations share this interface and one contract test suite: ``MqttTransport``
(paho-mqtt 2, MQTT v5, QoS 1) and ``InProcessTransport`` (a hub in this process, for
simulation and unit tests). Both deliver asynchronously, in order per publisher and topic, on a
delivery thread of the subscriber, so a slow handler never blocks the publisher.
"""

from __future__ import annotations

import abc
import collections
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from wire.errors import TransportClosed, TransportError
from wire.logs import warn

__all__ = [
    "Handler",
    "InProcessHub",
    "InProcessTransport",
    "Mailbox",
    "Transport",
    "Will",
    "matches",
    "split_shared",
]

Handler = Callable[[str, bytes], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Will:
    """Published by the broker when a client vanishes without a clean disconnect."""

    topic: str
    payload: bytes
    retain: bool = True


def split_shared(topic_filter: str) -> tuple[str | None, str]:
    """``$share/group/filter`` -> (group, filter); a plain filter -> (None, filter)."""
    if topic_filter.startswith("$share/"):
        _, group, rest = topic_filter.split("/", 2)
        return group, rest
    return None, topic_filter


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic matching with ``+`` and ``#``; wildcards never match ``$`` topics."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    levels, wanted = topic.split("/"), topic_filter.split("/")
    for index, part in enumerate(wanted):
        if part == "#":
            return True
        if index >= len(levels) or (part != "+" and part != levels[index]):
            return False
    return len(levels) == len(wanted)


class Transport(abc.ABC):
    """Publish and subscribe with at-least-once (QoS 1) delivery."""

    max_payload: int = 256 * 1024 * 1024

    @abc.abstractmethod
    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Send ``payload``; raises :class:`TransportError` if it exceeds ``max_payload``."""

    @abc.abstractmethod
    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        """Call ``handler(topic, payload)`` for matching messages (``$share/...`` allowed)."""

    @abc.abstractmethod
    def unsubscribe(self, topic_filter: str) -> None: ...

    def on_reconnect(self, callback: Callable[[], None]) -> None:  # noqa: B027 - optional
        """Run ``callback`` after every reconnection (a broker restart may have lost retained
        messages such as a presence). Transports that never reconnect ignore it."""

    def flush(self, timeout: float = 30.0) -> None:  # noqa: B027 - optional
        """Block until everything published so far has been accepted by the broker."""

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect cleanly (the will is not published)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Vanish without a clean disconnect, as a crash would: the broker publishes the
        will (a simulated client going offline, fault tests)."""

    def _check_size(self, payload: bytes) -> None:
        if len(payload) > self.max_payload:
            raise TransportError(
                f"payload of {len(payload)} bytes exceeds the transport's "
                f"limit of {self.max_payload}; send it through a Channel, "
                "which chunks large messages"
            )


_LINGER = 0.5  # seconds a delivery thread waits for more before it ends


def _deliver(handler: Handler, topic: str, payload: bytes) -> None:
    try:
        handler(topic, payload)
    except TransportClosed as error:  # its reply's transport closed: a shutdown, no fault
        log.info("handler for %s stopped: %s", topic, error)
    except TransportError as error:
        log.warning("handler for %s stopped: %s", topic, error)
    except Exception:  # a failing handler must not stop delivery to the others
        log.exception("handler for %s failed", topic)


ENTRY_BYTES = 128  # what a queued message costs besides its payload (tuple, deque slot)


class Mailbox:
    """A subscriber's ordered deliveries. Its thread runs only while there is something to
    deliver (it ends after a short idle spell), so a process hosting thousands of idle
    clients holds no thread for them, and a handler that blocks stalls its own client only.

    ``max_bytes`` (None: unbounded) bounds what may wait for a slow handler on one topic: a
    message past it is dropped (counted in ``dropped``, by topic, with a warning). The
    broker's ACL binds each device to its own topics, so a sender that floods them (a device
    ignoring its credits) loses its own messages, costs at most the bound per topic, and the
    others keep theirs. What a stream drops shows as batches missing at the end of the
    round, which is then redone. An honest sender holds at most its credit window there. A
    message on a topic with nothing waiting is always queued, so the bound never refuses a
    lone message, however large."""

    def __init__(self, name: str, max_bytes: int | None = None) -> None:
        self._name, self._max_bytes = name, max_bytes
        self._by_topic: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self._items: collections.deque[tuple[Handler, str, bytes]] = collections.deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def put(self, handler: Handler, topic: str, payload: bytes) -> None:
        self.put_all(handler, topic, (payload,))

    def put_all(self, handler: Handler, topic: str, payloads: Sequence[bytes]) -> None:
        """Queue ``payloads`` (a bundle's parts) for ``handler`` in order, with one wake-up."""
        size = sum(len(payload) + ENTRY_BYTES for payload in payloads)
        with self._condition:
            if self._stopped:
                return
            if self._over(topic, size):
                self.dropped[topic] += len(payloads)
                warn(
                    log,
                    ("mailbox", self._name, topic),
                    "%s dropped a message on %s: %d bytes on that topic wait for its handler "
                    "(the bound is %d; a broker URL's ?inbound=2GiB raises it)",
                    self._name,
                    topic,
                    self._by_topic[topic],
                    self._max_bytes,
                )
                return
            self._by_topic[topic] += size
            self._items.extend((handler, topic, payload) for payload in payloads)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"deliver-{self._name}", daemon=True
                )
                self._thread.start()
            else:
                self._condition.notify()

    def _over(self, topic: str, size: int) -> bool:
        """``topic`` would hold more than the bound with ``size`` bytes more (a message on a
        topic with nothing waiting always gets in: the broker bounds one message)."""
        waiting = self._by_topic[topic]
        return self._max_bytes is not None and waiting > 0 and waiting + size > self._max_bytes

    @property
    def queued_bytes(self) -> int:
        with self._condition:
            return sum(self._by_topic.values())

    def _run(self) -> None:
        while True:
            with self._condition:
                if not self._items and not self._stopped:
                    self._condition.wait(_LINGER)
                if not self._items:
                    self._thread = None
                    return
                handler, topic, payload = self._items.popleft()
                self._by_topic[topic] -= len(payload) + ENTRY_BYTES
                if self._by_topic[topic] <= 0:
                    del self._by_topic[topic]
            _deliver(handler, topic, payload)

    def stop(self, timeout: float = 10.0) -> None:
        """Deliver what is queued, then end; wait up to ``timeout`` s for the handler under
        way (closing a transport while a handler still publishes on another one fails it).
        Messages put after this are dropped."""
        with self._condition:
            self._stopped = True
            thread = self._thread
            self._condition.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


@dataclass(eq=False)
class _Subscription:
    order: int  # subscriptions are served in the order they were made
    client: InProcessTransport
    group: str | None
    plain: str
    handler: Handler


class _Level:
    """A node of the subscription tree: one topic level."""

    __slots__ = ("children", "here", "retained")

    def __init__(self) -> None:
        self.children: dict[str, _Level] = {}
        self.here: list[_Subscription] = []  # subscriptions whose filter ends at this level
        self.retained: bytes | None = None  # the message retained on the topic ending here


def _candidates(level: _Level, levels: list[str], index: int, out: list[_Subscription]) -> None:
    """Every subscription under ``level`` whose filter may match ``levels[index:]`` (a
    superset: :func:`matches` decides)."""
    if (rest := level.children.get("#")) is not None:
        out.extend(rest.here)
    if index == len(levels):
        out.extend(level.here)
        return
    for key in (levels[index], "+"):
        if (child := level.children.get(key)) is not None:
            _candidates(child, levels, index + 1, out)


def _stored(level: _Level, parts: list[str], path: list[str], out: list[tuple[str, bytes]]) -> None:
    """The retained messages under ``level`` (reached by ``path``) whose topics may match
    the filter levels ``parts`` (a superset: :func:`matches` decides)."""
    if not parts:
        if level.retained is not None:
            out.append(("/".join(path), level.retained))
        return
    part, rest = parts[0], parts[1:]
    if part == "#":
        _stored(level, [], path, out)
        for key, below in level.children.items():
            _stored(below, parts, [*path, key], out)
        return
    keys = list(level.children) if part == "+" else [part]
    for key in keys:
        if (child := level.children.get(key)) is not None:
            _stored(child, rest, [*path, key], out)


class InProcessHub:
    """The in-process broker: topics, retained messages, shared groups, last wills.
    Subscriptions sit in a tree of topic levels, so routing a publication costs the depth of
    its topic, not the number of subscriptions (thousands in a large simulation)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._root = _Level()
        self._order = itertools.count()
        self._retained = _Level()  # retained messages, by topic level
        self._turns: dict[str, itertools.count[int]] = {}

    def connect(self, client_id: str, will: Will | None = None) -> InProcessTransport:
        return InProcessTransport(self, client_id, will)

    def _level(self, plain: str, root: _Level | None = None) -> _Level:
        level = self._root if root is None else root
        for part in plain.split("/"):
            level = level.children.setdefault(part, _Level())
        return level

    def _subscribe(self, client: InProcessTransport, topic_filter: str, handler: Handler) -> None:
        group, plain = split_shared(topic_filter)
        with self._lock:
            subscription = _Subscription(next(self._order), client, group, plain, handler)
            self._level(plain).here.append(subscription)
            client.subscriptions.append(subscription)
            retained: list[tuple[str, bytes]] = []
            if group is None:
                _stored(self._retained, plain.split("/"), [], retained)
            retained = [(t, p) for t, p in retained if matches(plain, t)]
        for topic, payload in retained:
            client.mailbox.put(handler, topic, payload)

    def _remove(self, client: InProcessTransport, keep: Callable[[_Subscription], bool]) -> None:
        with self._lock:
            gone = [s for s in client.subscriptions if not keep(s)]
            client.subscriptions = [s for s in client.subscriptions if keep(s)]
            for subscription in gone:
                self._level(subscription.plain).here.remove(subscription)

    def _unsubscribe(self, client: InProcessTransport, topic_filter: str) -> None:
        group, plain = split_shared(topic_filter)
        self._remove(client, lambda s: not (s.group == group and s.plain == plain))

    def _drop(self, client: InProcessTransport) -> None:
        self._remove(client, lambda _s: False)

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain:
                self._level(topic, self._retained).retained = payload or None
            found: list[_Subscription] = []
            _candidates(self._root, topic.split("/"), 0, found)
            found.sort(key=lambda s: s.order)
            targets: list[tuple[InProcessTransport, Handler]] = []
            groups: dict[tuple[str, str], list[tuple[InProcessTransport, Handler]]] = {}
            for s in found:
                if matches(s.plain, topic):
                    if s.group is None:
                        targets.append((s.client, s.handler))
                    else:
                        groups.setdefault((s.group, s.plain), []).append((s.client, s.handler))
            for key, members in groups.items():
                turn = next(self._turns.setdefault(f"{key[0]}/{key[1]}", itertools.count()))
                targets.append(members[turn % len(members)])
        for client, handler in targets:
            client.mailbox.put(handler, topic, payload)


class InProcessTransport(Transport):
    """A client of an :class:`InProcessHub`."""

    def __init__(self, hub: InProcessHub, client_id: str, will: Will | None = None) -> None:
        self.hub, self.client_id, self.will = hub, client_id, will
        self.mailbox = Mailbox(client_id)
        self.subscriptions: list[_Subscription] = []
        self._closed = False

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.client_id!r} is closed")
        self._check_size(payload)
        self.hub.publish(topic, bytes(payload), retain)

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self.hub._subscribe(self, topic_filter, handler)

    def unsubscribe(self, topic_filter: str) -> None:
        self.hub._unsubscribe(self, topic_filter)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.hub._drop(self)
            self.mailbox.stop()

    def kill(self) -> None:
        """Vanish without a clean disconnect: the hub publishes the will, as a broker would."""
        if not self._closed:
            self.close()
            if self.will is not None:
                self.hub.publish(self.will.topic, self.will.payload, self.will.retain)
