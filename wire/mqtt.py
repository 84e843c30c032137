"""The MQTT transport: paho-mqtt 2, MQTT v5, QoS 1 for everything.

Persistent sessions (``clean_start=False`` plus a session-expiry interval) keep subscriptions
and queued QoS 1 messages across reconnects; subscriptions are re-sent when the broker did not
keep the session. paho reconnects with exponential backoff, at most ``reconnect_max`` (5 s)
apart, so an agent is back within seconds of a restarted broker; paho sends the QoS 1 messages
the broker had not acknowledged again (the Channel drops the duplicates). Upper layers see the
link through :attr:`MqttTransport.link_epoch` (one more each time it drops) and
:attr:`MqttTransport.last_reconnect` (when it came back): a will queued during an outage is
judged with that in mind (``wire.presence``), and a coordinator whose link dropped during a
try redoes it. Outgoing messages wait in a bounded queue: a producer faster than the network
blocks instead of growing memory or dropping data, and meanwhile its small messages to a topic
travel together (``wire.bundles``). The connection's settings are ``wire.mqtt_config``.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from wire.bundles import Held, bundle, holdable, parts_of
from wire.errors import TransportError
from wire.logs import warn
from wire.mqtt_config import MqttConfig, account_client_id, redact_url
from wire.mqtt_connect import connect_and_wait, note_refusal, paho_client
from wire.paho_decode import FastClient
from wire.transport import (
    ENTRY_BYTES,
    Handler,
    Mailbox,
    Transport,
    Will,
    matches,
    split_shared,
)

__all__ = [
    "MqttConfig",
    "MqttTransport",
    "account_client_id",
    "redact_url",
]

_UNCLAIMED_BYTES = 256 * 1024 * 1024
# what a kept message costs beyond its payload (a bundle of 4,096 tiny parts is 4,096 entries)
_UNCLAIMED_COUNT = 65_536

log = logging.getLogger(__name__)
_SESSION_TAKEN_OVER = 0x8E  # MQTT v5 DISCONNECT reason: a client with the same id connected
_BRIEF, _BRIEF_IN_A_ROW = 5.0, 3  # connections lost this soon, this often: a shared id?


class MqttTransport(Transport):
    """A connected MQTT v5 client."""

    def __init__(
        self, config: MqttConfig, client_id: str | None = None, will: Will | None = None
    ) -> None:
        self.config = config
        self.client_id = account_client_id(
            config.username, client_id or f"edgesplit-{uuid.uuid4().hex[:12]}"
        )
        self.max_payload = config.max_payload
        self._handlers: dict[str, tuple[int, Handler]] = {}  # filter -> (subscription id, ...)
        self._next_id = 1
        self._lock = threading.Lock()
        self._connected = threading.Event()
        # Message ids sent but not yet acknowledged; acks that beat publish() wait in _acked.
        self._outstanding: set[int] = set()
        self._acked: set[int] = set()
        self._acks = threading.Condition()
        self._held = Held(config.bundle_bytes)  # guarded by _acks
        # paho's queue room a drain leaves (0: unbounded); bundles only where a drain at
        # bundle_after outstanding messages finds room, else an ack's drain could never send
        self._room = config.max_queued - 2 if config.max_queued > 0 else float("inf")
        self._bundle_bytes = config.bundle_bytes if config.bundle_after < self._room else 0
        self._awaiting = 0  # publishers and flushes waiting for what is held to go
        self._draining = False
        self.bundles_sent = self.bundled = 0  # bundles published, payloads they carried
        self.malformed = 0  # bundles received whose frame was broken (dropped whole)
        self.mailbox = Mailbox(self.client_id, config.inbound_bound)
        self._closed = False
        # asked, once the link drops, why not to connect again (None: reconnect). A
        # coordinator's says when its run is another's: woken from a freeze, its reconnect
        # knocked its successor, with the same client id, off the broker before its lease
        # thread found the run lost
        self.reconnect_gate: Callable[[], str | None] | None = None
        self._brief = 0  # connections in a row lost within _BRIEF seconds of connecting
        self._connected_at = -math.inf  # when the latest connection came up (monotonic)
        self.refused: collections.Counter[str] = collections.Counter()  # PUBACK >= 0x80
        # Messages of a resumed session can arrive before their handler is registered again:
        # keep them (bounded) until a matching subscribe() comes.
        self._unclaimed: collections.deque[tuple[str, bytes]] = collections.deque()
        self._unclaimed_bytes = 0
        self._reconnect_hooks: list[Callable[[], None]] = []
        self._connections = 0
        self.link_epoch = 0  # one more each time the connection drops
        self.last_reconnect: float | None = None  # time.monotonic() of the latest reconnection
        self._refusals: list[str] = []  # the broker's CONNACK refusals, while connecting
        self._client = self._build(will)
        self._connect()

    def _build(self, will: Will | None) -> FastClient:
        client = paho_client(self.client_id, self.config, will)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    def _connect(self) -> None:
        fresh = mqtt.MQTT_CLEAN_START_FIRST_ONLY if self.config.fresh_session else None
        clean = self.config.clean_start if fresh is None else fresh
        connect_and_wait(self._client, self.config, self._connected, clean, self._refusals)

    # ---------------------------------------------------------------- paho callbacks
    def _on_connect(
        self, client: mqtt.Client, _userdata: Any, flags: Any, reason: Any, _properties: Any
    ) -> None:
        if reason.is_failure:
            note_refusal(reason, self._refusals)
            return
        if not flags.session_present:
            with self._lock:
                filters = [(f, i) for f, (i, _) in self._handlers.items()]
            for topic_filter, identifier in filters:
                self._send_subscribe(topic_filter, identifier)
        self._connections += 1
        self._connected_at = time.monotonic()
        if self._connections > 1:
            self.last_reconnect = time.monotonic()
            log.warning(
                "MQTT connection back (session %s)", "kept" if flags.session_present else "new"
            )
            # hooks publish: never block the network thread (it processes the acks) on them
            threading.Thread(target=self._run_hooks, name="reconnect-hooks", daemon=True).start()
        self._connected.set()

    def _run_hooks(self) -> None:
        for hook in list(self._reconnect_hooks):
            try:
                hook()
            except Exception:  # a failing hook must not stop the others
                log.exception("reconnect hook failed")

    def _send_subscribe(self, topic_filter: str, identifier: int) -> int:
        properties = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
        properties.SubscriptionIdentifier = identifier
        result, _ = self._client.subscribe(topic_filter, qos=1, properties=properties)
        return int(result)

    def _on_publish(
        self, _client: mqtt.Client, _userdata: Any, mid: int, reason: Any, _properties: Any
    ) -> None:
        if reason.is_failure:  # e.g. "Not authorized": an ACL forbids this topic
            self.refused[str(reason)] += 1
            log.error("the broker refused message %s: %s", mid, reason)
        with self._acks:
            if mid in self._outstanding:
                self._outstanding.discard(mid)
            else:
                self._acked.add(mid)
            self._acks.notify_all()
            drain = self._drain_now()
        if drain:
            self._drain()

    def _drain_now(self) -> bool:
        """Whether what is held should go now (under ``_acks``): when fewer than
        ``bundle_after`` messages await acks, or as soon as there is room while a publisher
        or a flush waits for it (else a large message would wait for the window to empty)."""
        waiting = len(self._outstanding)
        wanted = waiting < self.config.bundle_after or self._awaiting > 0
        return bool(self._held) and wanted and waiting < self._room

    def _on_disconnect(
        self, _client: mqtt.Client, _userdata: Any, _flags: Any, reason: Any, _properties: Any
    ) -> None:
        if self._connected.is_set():
            self.link_epoch += 1
        self._connected.clear()
        if reason.value == 0 or self._closed:
            return
        if self.reconnect_gate is not None and (why := _why_not(self.reconnect_gate)):
            log.warning("MQTT connection lost (%s); not reconnecting: %s", reason, why)
            self._client.stop_reconnecting()
            return
        # lost within seconds of connecting, again and again: most often another client
        # taking the same client id in turn (mosquitto closes without saying why)
        brief = time.monotonic() - self._connected_at < _BRIEF
        self._brief = self._brief + 1 if brief else 0
        if reason.value == _SESSION_TAKEN_OVER or self._brief >= _BRIEF_IN_A_ROW:
            warn(
                log,
                "taken over",
                "MQTT connection lost (%s), %d time(s) in a row within %.0f s of connecting: "
                "is another client connected with this one's client id %r (a second agent "
                "started with the same --id)? Two agents cannot share an id: each takes the "
                "other's connection in turn until one stops; reconnecting",
                reason,
                self._brief,
                _BRIEF,
                self.client_id,
                level=logging.ERROR,
            )
            return
        log.warning("MQTT connection lost (%s); reconnecting", reason)

    def _on_message(self, _client: mqtt.Client, _userdata: Any, message: mqtt.MQTTMessage) -> None:
        # With overlapping subscriptions the broker sends one copy per subscription, each
        # naming its subscription identifiers: deliver each copy to exactly those handlers.
        identifiers = set(getattr(message.properties, "SubscriptionIdentifier", None) or ())
        parts = parts_of(message.topic, bytes(message.payload), log)
        if not parts:
            self.malformed += 1
        with self._lock:
            if identifiers:
                targets = [h for i, h in self._handlers.values() if i in identifiers]
            else:
                targets = [
                    h
                    for f, (_, h) in self._handlers.items()
                    if matches(split_shared(f)[1], message.topic)
                ]
            if not targets:
                for part in parts:
                    self._keep_unclaimed(message.topic, part)
                return
        for handler in targets:
            self.mailbox.put_all(handler, message.topic, parts)

    # ---------------------------------------------------------------- Transport
    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self._check_size(payload)
        if holdable(topic, payload, retain, self._bundle_bytes):
            if self._held_back(topic, payload):
                return
        else:  # keep the order: what is held back goes first
            self._held_gone(60.0)
        self._publish_now(topic, payload, retain)

    def _held_gone(self, timeout: float) -> None:
        """Send what is held and wait until it is in paho's hands."""
        with self._acks:
            self._awaiting += 1
        try:
            self._drain()
            self._wait_until(lambda: not self._held and not self._draining, timeout)
        finally:
            with self._acks:
                self._awaiting -= 1

    def _held_back(self, topic: str, payload: bytes) -> bool:
        """Hold ``payload`` for a bundle while earlier messages await their acknowledgements
        (or are held themselves); whether it was held. At most 4 bundles' worth is held: a
        producer beyond that waits, as for paho's bounded queue."""
        cap = 4 * self.config.bundle_bytes
        with self._acks:
            after = self.config.bundle_after
            if not (self._held or self._draining or len(self._outstanding) >= after):
                return False
            self._wait_until(lambda: self._held.bytes < cap)
            self._held.add(topic, payload)
            idle = len(self._outstanding) < after  # acked meanwhile: no ack will send it
        if idle:
            self._drain()
        return True

    def _publish_now(self, topic: str, payload: bytes, retain: bool) -> None:
        while True:
            info = self._client.publish(topic, payload, qos=1, retain=retain)
            if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:  # bounded queue full: wait for the broker
                self._wait_until(lambda: len(self._outstanding) < self.config.max_queued)
                continue
            self._register(topic, info)
            return

    def _register(self, topic: str, info: mqtt.MQTTMessageInfo) -> None:
        # MQTT_ERR_NO_CONN: paho keeps QoS 1 messages and sends them after reconnecting.
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(f"publish to {topic!r} failed: {mqtt.error_string(info.rc)}")
        with self._acks:
            if info.mid in self._acked:
                self._acked.discard(info.mid)
            else:
                self._outstanding.add(info.mid)

    def _drain(self) -> None:
        """Send what is held, one message per run, while paho's queue has room. One drainer
        at a time: the network thread (on an acknowledgement) or a publisher."""
        while True:
            with self._acks:
                if self._draining or not self._held:
                    return
                self._draining = True
            try:
                while self._send_held():
                    pass
            finally:
                with self._acks:
                    self._draining = False
                    self._acks.notify_all()
                    again = self._drain_now()
            if not again:  # else something was held while this drainer stopped
                return

    def _send_held(self) -> bool:
        """Publish the oldest held run; False when none is held or paho's queue is full."""
        with self._acks:
            if not self._held or len(self._outstanding) >= self._room:
                return False
            topic, parts = self._held.take()
            self._acks.notify_all()  # room for a waiting producer
        info = self._client.publish(topic, parts[0] if len(parts) == 1 else bundle(parts), qos=1)
        if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:
            with self._acks:
                self._held.put_back(topic, parts)
            return False
        try:
            self._register(topic, info)
        except TransportError as error:  # on the network thread: log, never raise
            log.error("%s (%d messages lost)", error, len(parts))
            return True
        if len(parts) > 1:
            self.bundles_sent += 1
            self.bundled += len(parts)
        return True

    def _wait_until(self, ready: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self._acks:
            while not ready():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"the broker acknowledged nothing for {timeout:.0f} s "
                        f"({len(self._outstanding)} messages outstanding)"
                    )
                self._acks.wait(min(remaining, 0.5))

    def flush(self, timeout: float = 30.0) -> None:
        self._held_gone(timeout)
        self._wait_until(lambda: not self._outstanding, timeout)

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        self._reconnect_hooks.append(callback)

    def _keep_unclaimed(self, topic: str, payload: bytes) -> None:
        """Hold a message no handler wants yet; beyond the bound, drop the oldest loudly."""
        self._unclaimed.append((topic, payload))
        self._unclaimed_bytes += len(payload) + ENTRY_BYTES
        while self._unclaimed and (
            self._unclaimed_bytes > _UNCLAIMED_BYTES or len(self._unclaimed) > _UNCLAIMED_COUNT
        ):
            dropped_topic, dropped = self._unclaimed.popleft()
            self._unclaimed_bytes -= len(dropped) + ENTRY_BYTES
            log.error("dropped an unclaimed message on %s: no handler subscribed", dropped_topic)

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        with self._lock:
            plain = split_shared(topic_filter)[1]
            claimed = [(t, p) for t, p in self._unclaimed if matches(plain, t)]
            if claimed:
                self._unclaimed = collections.deque(
                    (t, p) for t, p in self._unclaimed if not matches(plain, t)
                )
                self._unclaimed_bytes = sum(len(p) + ENTRY_BYTES for _, p in self._unclaimed)
            for topic, payload in claimed:
                self.mailbox.put(handler, topic, payload)
            identifier = self._handlers.get(topic_filter, (self._next_id, handler))[0]
            self._next_id = max(self._next_id, identifier + 1)
            self._handlers[topic_filter] = (identifier, handler)
        result = self._send_subscribe(topic_filter, identifier)
        if result not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            raise TransportError(
                f"subscribe to {topic_filter!r} failed: {mqtt.error_string(result)}"
            )

    def unsubscribe(self, topic_filter: str) -> None:
        with self._lock:
            self._handlers.pop(topic_filter, None)
        self._client.unsubscribe(topic_filter)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(timeout=5.0)
        except TransportError:
            log.warning("closing with unacknowledged messages")
        self._disconnect()

    def leave(self) -> None:
        """Disconnect now and never reconnect, without waiting for what is unacknowledged
        (a coordinator whose run was taken over: its reconnect would knock its successor,
        with the same client id, off the broker)."""
        if self._closed:
            return
        self._closed = True
        self._disconnect()

    def _disconnect(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
        self.mailbox.stop()

    def kill(self) -> None:
        """Drop the network connection without DISCONNECT, as a crash would (for tests)."""
        if self._closed:
            return
        self._closed = True
        self._client.loop_stop()
        with self._acks:
            self._held.clear()  # a crash loses what was held back, as it does paho's queue
        sock = self._client.socket()
        if sock is not None:
            sock.close()
        self.mailbox.stop()


def _why_not(gate: Callable[[], str | None]) -> str | None:
    """``gate()``; None (reconnect) when it fails: a store that cannot be read now says
    nothing of whose the run is."""
    try:
        return gate()
    except Exception as error:
        log.warning("asking whether to reconnect failed (%s): reconnecting", error)
        return None
