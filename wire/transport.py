"""The transport seam: publish bytes to a topic, subscribe a handler to a topic filter.

Two implementations share this interface and one contract test suite: ``MqttTransport``
(paho-mqtt 2, MQTT v5, QoS 1) and ``InProcessTransport`` (a hub in this process, for
simulation and unit tests). Both deliver asynchronously, in order per publisher and topic, on a
delivery thread of the subscriber, so a slow handler never blocks the publisher.
"""

from __future__ import annotations

import abc
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from wire.errors import TransportError

__all__ = [
    "Handler",
    "InProcessHub",
    "InProcessTransport",
    "Transport",
    "Will",
    "matches",
    "split_shared",
]

Handler = Callable[[str, bytes], None]


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


class _Mailbox:
    """A subscriber's ordered delivery queue and its thread."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[tuple[Handler, str, bytes] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"deliver-{name}", daemon=True)
        self._thread.start()

    def put(self, handler: Handler, topic: str, payload: bytes) -> None:
        self._queue.put((handler, topic, payload))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            handler, topic, payload = item
            try:
                handler(topic, payload)
            except TransportError as error:  # e.g. its reply's transport closed (shutdown)
                logging.getLogger(__name__).warning("handler for %s stopped: %s", topic, error)
            except Exception:  # a failing handler must not stop delivery to the others
                logging.getLogger(__name__).exception("handler for %s failed", topic)

    def stop(self, timeout: float = 10.0) -> None:
        """Deliver what is queued, then end; wait up to ``timeout`` s for the handler under
        way (closing a transport while a handler still publishes on another one fails it)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class InProcessHub:
    """The in-process broker: topics, retained messages, shared groups, last wills."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._subscriptions: list[tuple[InProcessTransport, str | None, str, Handler]] = []
        self._retained: dict[str, bytes] = {}
        self._turns: dict[str, itertools.count[int]] = {}

    def connect(self, client_id: str, will: Will | None = None) -> InProcessTransport:
        return InProcessTransport(self, client_id, will)

    def _subscribe(self, client: InProcessTransport, topic_filter: str, handler: Handler) -> None:
        group, plain = split_shared(topic_filter)
        with self._lock:
            self._subscriptions.append((client, group, plain, handler))
            retained = (
                [] if group else [(t, p) for t, p in self._retained.items() if matches(plain, t)]
            )
        for topic, payload in retained:
            client.mailbox.put(handler, topic, payload)

    def _unsubscribe(self, client: InProcessTransport, topic_filter: str) -> None:
        group, plain = split_shared(topic_filter)
        with self._lock:
            self._subscriptions = [
                s
                for s in self._subscriptions
                if not (s[0] is client and s[1] == group and s[2] == plain)
            ]

    def _drop(self, client: InProcessTransport) -> None:
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if s[0] is not client]

    def publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            targets: list[tuple[InProcessTransport, Handler]] = []
            groups: dict[tuple[str, str], list[tuple[InProcessTransport, Handler]]] = {}
            for client, group, plain, handler in self._subscriptions:
                if matches(plain, topic):
                    if group is None:
                        targets.append((client, handler))
                    else:
                        groups.setdefault((group, plain), []).append((client, handler))
            for key, members in groups.items():
                turn = next(self._turns.setdefault(f"{key[0]}/{key[1]}", itertools.count()))
                targets.append(members[turn % len(members)])
        for client, handler in targets:
            client.mailbox.put(handler, topic, payload)


class InProcessTransport(Transport):
    """A client of an :class:`InProcessHub`."""

    def __init__(self, hub: InProcessHub, client_id: str, will: Will | None = None) -> None:
        self.hub, self.client_id, self.will = hub, client_id, will
        self.mailbox = _Mailbox(client_id)
        self._closed = False

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if self._closed:
            raise TransportError(f"transport {self.client_id!r} is closed")
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
