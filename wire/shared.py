"""Many logical MQTT clients over a few real connections (a simulation of 1,000 clients).

``SharedMqtt.connect(name, will)`` hands out a ``SharedView``: a :class:`Transport` with its own
subscriptions, handlers, delivery order, acknowledgements, ``close()`` and ``kill()``, that
shares a paho connection (one socket, one network thread) with up to ``per_connection`` other
views. Nothing changes on the wire: the broker sees a few clients with the union of their
views' subscriptions.

- **Routing.** One MQTT subscription per distinct filter on a connection, reference-counted by
  the views holding it; each has a subscription identifier, so a message is routed to exactly
  the views of the subscriptions the broker names. A shared subscription (``$share/...``)
  reaches a connection once per message: one of its views gets it, in turn.
- **Retained messages.** The broker sends them only when a connection subscribes, so each
  connection keeps the retained messages of its plain filters (``retainAsPublished``: a live
  retained message is marked, an empty one deletes) and gives a view that joins an existing
  subscription the matching ones itself.
- **Delivery.** Each view delivers in order on its own thread, which runs only while the view
  has messages (it ends after a short idle spell): a handler that blocks (a Flower node trains
  a whole round in one) stalls its own view only, and an idle client costs no thread. A bounded
  pool was rejected: a pool's worth of training handlers waiting for credits that only the
  pool could deliver would deadlock.
- **Acknowledgements.** ``publish`` behaves as ``MqttTransport.publish`` (it blocks only while
  the connection's queue is full); ``flush`` waits for the broker's acks of this view's own
  messages, not its neighbours'.
- **Wills.** A connection has no will: a view's will cannot be registered with the broker.
  ``kill()`` publishes the view's will itself (after dropping its subscriptions), as the broker
  would for a crashed client; ``close()`` does not, as a clean MQTT disconnect does not. A crash
  of the whole process publishes no view's will: the presence the views last published stays.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from wire.bundles import parts_of
from wire.errors import TransportClosed, TransportError
from wire.mqtt import MqttConfig, account_client_id
from wire.mqtt_connect import connect_and_wait, note_refusal, paho_client
from wire.transport import Handler, Mailbox, Transport, Will, matches, split_shared

__all__ = ["SharedMqtt", "SharedView"]

log = logging.getLogger(__name__)

_INFLIGHT = 64  # unacknowledged QoS 1 messages on the wire per connection


class _Subscription:
    """One MQTT subscription of a connection and the views holding it (in joining order)."""

    def __init__(self, topic_filter: str, identifier: int) -> None:
        self.topic_filter, self.identifier = topic_filter, identifier
        self.group, self.plain = split_shared(topic_filter)
        self.views: dict[SharedView, Handler] = {}
        self._turn = 0

    def targets(self) -> list[tuple[SharedView, Handler]]:
        """Every view; for a shared subscription, the next view in turn."""
        members = list(self.views.items())
        if self.group is None or not members:
            return members
        self._turn += 1
        return [members[self._turn % len(members)]]


class _Connection:
    """One paho client carrying the views' subscriptions and publications."""

    def __init__(self, config: MqttConfig, client_id: str) -> None:
        self.config = config
        self.client_id = account_client_id(config.username, client_id)
        self.views: set[SharedView] = set()
        self._lock = threading.Lock()
        self._subscriptions: dict[str, _Subscription] = {}
        self._by_id: dict[int, _Subscription] = {}
        self._next_id = 1
        self._retained: dict[str, bytes] = {}
        self._acks = threading.Condition()
        self._pending: dict[int, SharedView | None] = {}  # message id -> publishing view
        self._early: set[int] = set()  # acks that beat publish() to _pending
        self.malformed = 0  # bundles received whose frame was broken (dropped whole)
        self._connected = threading.Event()
        self._connections = 0
        self.max_queued = config.max_queued * 4
        self._client = self._build()
        self._connect()

    def _build(self) -> mqtt.Client:
        client = paho_client(self.client_id, self.config, max_queued=self.max_queued)
        client.max_inflight_messages_set(_INFLIGHT)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    def _connect(self) -> None:
        self._refusals: list[str] = []
        connect_and_wait(
            self._client, self.config, self._connected, self.config.clean_start, self._refusals
        )

    # ---------------------------------------------------------------- paho callbacks
    def _on_connect(
        self, _client: mqtt.Client, _userdata: Any, flags: Any, reason: Any, _props: Any
    ) -> None:
        if reason.is_failure:
            note_refusal(reason, self._refusals)
            return
        if not flags.session_present:
            with self._lock:
                held = [(s.topic_filter, s.identifier) for s in self._subscriptions.values()]
            for topic_filter, identifier in held:
                self._send_subscribe(topic_filter, identifier)
        self._connections += 1
        if self._connections > 1:  # hooks publish: never block the network thread on them
            threading.Thread(target=self._run_hooks, name="reconnect-hooks", daemon=True).start()
        self._connected.set()

    def _run_hooks(self) -> None:
        with self._lock:
            hooks = [hook for view in self.views for hook in view.hooks]
        for hook in hooks:
            try:
                hook()
            except Exception:  # a failing hook must not stop the others
                log.exception("reconnect hook failed")

    def _on_disconnect(
        self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason: Any, _props: Any
    ) -> None:
        self._connected.clear()
        if reason.value != 0:
            log.warning("MQTT connection lost (%s); reconnecting", reason)

    def _on_publish(
        self, _client: mqtt.Client, _userdata: Any, mid: int, reason: Any, _props: Any
    ) -> None:
        if reason.is_failure:  # e.g. "Not authorized": an ACL forbids this topic
            log.error("the broker refused message %s: %s", mid, reason)
        with self._acks:
            if mid in self._pending:
                view = self._pending.pop(mid)
            else:
                view = None
                self._early.add(mid)
            self._acks.notify_all()
        if view is not None:
            view.acknowledged()

    def _on_message(self, _client: mqtt.Client, _userdata: Any, message: mqtt.MQTTMessage) -> None:
        topic, payload = message.topic, bytes(message.payload)
        identifiers = getattr(message.properties, "SubscriptionIdentifier", None) or ()
        with self._lock:
            if message.retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            if identifiers:
                held = [self._by_id[i] for i in identifiers if i in self._by_id]
            else:
                held = [s for s in self._subscriptions.values() if matches(s.plain, topic)]
            targets = [target for subscription in held for target in subscription.targets()]
        parts = parts_of(topic, payload, log)  # a bundle's parts (wire.bundles)
        if not parts:
            self.malformed += 1
        for view, handler in targets:  # one payload object for every view: no copies
            view.mailbox.put_all(handler, topic, parts)

    # ---------------------------------------------------------------- for the views
    def publish(self, view: SharedView | None, topic: str, payload: bytes, retain: bool) -> None:
        while True:
            info = self._client.publish(topic, payload, qos=1, retain=retain)
            if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:  # the connection's queue is full
                self._wait_for_room()
                continue
            # MQTT_ERR_NO_CONN: paho keeps QoS 1 messages and sends them after reconnecting.
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise TransportError(f"publish to {topic!r} failed: {mqtt.error_string(info.rc)}")
            with self._acks:
                if info.mid in self._early:
                    self._early.discard(info.mid)
                    return
                self._pending[info.mid] = view
                if view is not None:
                    view.sent()
            return

    def _wait_for_room(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self._acks:
            while len(self._pending) >= self.max_queued:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"the broker acknowledged nothing for {timeout:.0f} s "
                        f"({len(self._pending)} messages outstanding)"
                    )
                self._acks.wait(0.5)

    def _send_subscribe(self, topic_filter: str, identifier: int) -> int:
        properties = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
        properties.SubscriptionIdentifier = identifier
        options = SubscribeOptions(qos=1, retainAsPublished=True)
        result, _ = self._client.subscribe(topic_filter, options=options, properties=properties)
        return int(result)

    def subscribe(self, view: SharedView, topic_filter: str, handler: Handler) -> None:
        with self._lock:
            subscription = self._subscriptions.get(topic_filter)
            new = subscription is None
            if subscription is None:
                subscription = _Subscription(topic_filter, self._next_id)
                self._next_id += 1
                self._subscriptions[topic_filter] = subscription
                self._by_id[subscription.identifier] = subscription
            subscription.views[view] = handler
            retained = [
                (topic, payload)
                for topic, payload in self._retained.items()
                if not new and subscription.group is None and matches(subscription.plain, topic)
            ]
        for topic, payload in retained:  # split as when it came live
            view.mailbox.put_all(handler, topic, parts_of(topic, payload, log))
        if new:
            result = self._send_subscribe(topic_filter, subscription.identifier)
            if result not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise TransportError(
                    f"subscribe to {topic_filter!r} failed: {mqtt.error_string(result)}"
                )

    def unsubscribe(self, view: SharedView, topic_filter: str) -> None:
        with self._lock:
            subscription = self._subscriptions.get(topic_filter)
            if subscription is None or subscription.views.pop(view, None) is None:
                return
            if subscription.views:
                return
            del self._subscriptions[topic_filter], self._by_id[subscription.identifier]
            self._forget_retained(subscription)
        self._client.unsubscribe(topic_filter)

    def _forget_retained(self, gone: _Subscription) -> None:
        """Drop the retained messages only ``gone`` matched (under the lock)."""
        if gone.group is not None:
            return
        orphans = [t for t in self._retained if matches(gone.plain, t)]
        if not orphans:
            return
        plain = [s.plain for s in self._subscriptions.values() if s.group is None]
        for topic in orphans:
            if not any(matches(f, topic) for f in plain):
                del self._retained[topic]

    def attach(self, view: SharedView) -> None:
        with self._lock:
            self.views.add(view)

    def detach(self, view: SharedView) -> None:
        with self._lock:
            self.views.discard(view)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


class SharedView(Transport):
    """A logical client of a shared connection (see the module's docstring)."""

    def __init__(self, connection: _Connection, name: str, will: Will | None = None) -> None:
        self.client_id, self.will = name, will
        self.max_payload = connection.config.max_payload
        self.mailbox = Mailbox(name)  # a simulation's own clients: trusted, not bounded
        self.hooks: list[Callable[[], None]] = []
        self._connection = connection
        self._filters: set[str] = set()
        self._unacked = 0
        self._acks = threading.Condition()
        self._closed = False

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.client_id!r} is closed")
        self._check_size(payload)
        self._connection.publish(self, topic, payload, retain)

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        if self._closed:
            raise TransportClosed(f"transport {self.client_id!r} is closed")
        self._filters.add(topic_filter)
        self._connection.subscribe(self, topic_filter, handler)

    def unsubscribe(self, topic_filter: str) -> None:
        self._filters.discard(topic_filter)
        self._connection.unsubscribe(self, topic_filter)

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        self.hooks.append(callback)

    def sent(self) -> None:
        with self._acks:
            self._unacked += 1

    def acknowledged(self) -> None:
        with self._acks:
            self._unacked -= 1
            if self._unacked <= 0:
                self._acks.notify_all()

    def flush(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._acks:
            while self._unacked > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"the broker acknowledged nothing for {timeout:.0f} s "
                        f"({self._unacked} messages of {self.client_id!r} outstanding)"
                    )
                self._acks.wait(remaining)

    def _detach(self) -> None:
        self._closed = True
        for topic_filter in list(self._filters):
            self.unsubscribe(topic_filter)
        self._connection.detach(self)
        self.mailbox.stop()

    def close(self) -> None:
        """Leave cleanly: wait (up to 5 s) for this view's acks; the will is not published."""
        if self._closed:
            return
        try:
            self.flush(timeout=5.0)
        except TransportError:
            log.warning("closing %s with unacknowledged messages", self.client_id)
        self._detach()

    def kill(self) -> None:
        """Vanish as a crash would: no more deliveries, and the will is published (by this
        view, as the broker would for a client of its own)."""
        if self._closed:
            return
        self._detach()
        if self.will is not None:
            self._connection.publish(None, self.will.topic, self.will.payload, self.will.retain)


class SharedMqtt:
    """Hands out :class:`SharedView` clients, ``per_connection`` (open ones) per connection."""

    def __init__(self, config: MqttConfig, per_connection: int = 128) -> None:
        if per_connection < 1:
            raise ValueError(f"per_connection: expected at least 1, got {per_connection}")
        self.config, self.per_connection = config, per_connection
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def connect(self, name: str, will: Will | None = None) -> SharedView:
        """A new logical client ``name`` (names need not be unique: they are no MQTT ids)."""
        with self._lock:
            room = [c for c in self._connections if len(c.views) < self.per_connection]
            if room:
                connection = room[0]
            else:
                connection = _Connection(self.config, f"edgesplit-shared-{uuid.uuid4().hex[:12]}")
                self._connections.append(connection)
            view = SharedView(connection, name, will)
            connection.attach(view)
        return view

    def close(self) -> None:
        """Close every view still open (their wills are not published), then disconnect."""
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            for view in list(connection.views):
                view.close()
            connection.close()
