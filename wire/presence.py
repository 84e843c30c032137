"""Who is offline: every device's retained presence, ``online <node id> <incarnation>`` or its
last will ``offline`` (``edgesplit/v1/presence/<device>``).

A device that dies mid-round (killed, or its connection lost past the broker's keepalive) has
its last will published at once by the broker; the agents that wait on it in a round watch
presence so they stop waiting: a GPU server ends a dead sender's part of the round, an edge
gives up a round whose GPU server went offline (:class:`PeerOffline`).

**A will takes effect after a grace** (:class:`WillGrace`): a broker that shuts down publishes
every client's will, and a restarted one delivers the wills queued for a persistent session
while the devices are still reconnecting. So an ``offline`` counts only when no ``online``
follows it within :data:`WILL_GRACE_SECONDS` (a killed device costs that much more), never
while this process's own link is down, and not before :data:`RECONNECT_GRACE_SECONDS` after
its link came back (the devices need as long to reconnect and say ``online`` again).

**A restarted device is a dead one for the work it had** (:func:`incarnation_of`): each process
says ``online`` with its own random incarnation, the same on every reconnection. A device back
within the grace under a new incarnation is another process, which knows nothing of the round
its predecessor was in: waiters that began before it came back (``offline(since=...)``) stop
waiting for it at once, and it is online for the work that follows.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from wire import topics
from wire.transport import Transport

__all__ = [
    "RECONNECT_GRACE_SECONDS",
    "WILL_GRACE_SECONDS",
    "PeerOffline",
    "PresenceWatch",
    "WillGrace",
    "incarnation_of",
    "link_of",
    "new_incarnation",
]

WILL_GRACE_SECONDS = 2.0
RECONNECT_GRACE_SECONDS = 15.0
_INCARNATION = re.compile(r"[0-9a-f]{16}")


def new_incarnation() -> str:
    """A process's own incarnation: 16 random hex digits."""
    return secrets.token_hex(8)


def incarnation_of(payload: bytes) -> str:
    """The incarnation an ``online <node id> <incarnation>`` presence names; "" for none or a
    malformed one (an older agent says only ``online <node id>``)."""
    parts = payload.split()
    if len(parts) == 3 and parts[0] == b"online":
        text = parts[2].decode("ascii", "replace")
        if _INCARNATION.fullmatch(text):
            return text
    return ""


class PeerOffline(RuntimeError):
    """A device this one waited on in a round went offline (it said so as it stopped, or the
    broker published its last will)."""

    def __init__(self, round_number: int, devices: Iterable[str], role: str = "GPU server") -> None:
        self.round_number, self.devices = round_number, sorted(devices)
        names = ", ".join(self.devices)
        super().__init__(
            f"round {round_number} given up: {role} {names} went offline (stopped, or its "
            "link lost) while this device waited on it"
        )


def link_of(transport: object) -> Callable[[], tuple[bool, float | None]]:
    """``transport``'s link as :class:`WillGrace` reads it: (connected now, monotonic time of
    its latest reconnection or None). A transport that never loses its link (in-process) is
    always up."""

    def link() -> tuple[bool, float | None]:
        return (
            bool(getattr(transport, "connected", True)),
            getattr(transport, "last_reconnect", None),
        )

    return link


class WillGrace:
    """The pure rule: when a device's ``offline`` (seen at ``since``) counts.

    ``offline`` counts once ``grace`` seconds passed without an ``online``, the own link is
    up, and ``after_reconnect`` seconds passed since the own link came back."""

    def __init__(
        self,
        grace: float = WILL_GRACE_SECONDS,
        after_reconnect: float = RECONNECT_GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace, self.after_reconnect, self._clock = grace, after_reconnect, clock
        self._since: dict[str, float] = {}  # device -> when its pending offline was seen
        self._incarnation: dict[str, str] = {}  # device -> the process last seen online
        self._restarted: dict[str, float] = {}  # device -> when a new process came online

    def went_offline(self, device: str) -> None:
        self._since.setdefault(device, self._clock())

    def came_online(self, device: str, incarnation: str = "") -> None:
        """``device`` is online; under another ``incarnation`` than before, it restarted."""
        self._since.pop(device, None)
        if incarnation:
            known = self._incarnation.get(device)
            if known is not None and known != incarnation:
                self._restarted[device] = self._clock()
            self._incarnation[device] = incarnation

    def restarted(self, devices: Iterable[str], since: float) -> list[str]:
        """Those of ``devices`` that came back as a new process at or after ``since``."""
        wanted = devices if isinstance(devices, set | frozenset) else set(devices)
        restarts = list(self._restarted.items())  # one copy: another thread may add to it
        return sorted(d for d, at in restarts if at >= since and d in wanted)

    def effective_at(self, device: str, reconnected: float | None) -> float:
        """When ``device``'s offline counts (inf: it is not offline)."""
        since = self._since.get(device)
        if since is None:
            return math.inf
        due = since + self.grace
        if reconnected is not None:
            due = max(due, reconnected + self.after_reconnect)
        return due

    def offline(
        self,
        devices: Iterable[str],
        link: tuple[bool, float | None] = (True, None),
        since: float | None = None,
    ) -> list[str]:
        """Those of ``devices`` whose offline counts now, sorted, and with ``since`` (a
        waiter's start, this clock's time) those restarted since then; none while the own link
        (``link``: connected, latest reconnection) is down."""
        connected, reconnected = link
        if not connected:
            return []
        now, wanted = self._clock(), set(devices)
        # only a device with a pending offline can count (a loop over all the devices asked
        # about was quadratic for a server polling a round's thousand senders)
        pending = [d for d in list(self._since) if d in wanted]
        gone = {d for d in pending if self.effective_at(d, reconnected) <= now}
        if since is not None:
            gone |= set(self.restarted(wanted, since))
        return sorted(gone)


class PresenceWatch:
    """The devices whose latest presence is ``offline`` (after :class:`WillGrace`), followed
    on ``transport`` for the devices asked about: a device's presence topic is subscribed to
    the first time it is asked for (its retained presence arrives then), so an agent hears
    only the devices it waits on, not every device's comings and goings. A device never heard
    of is not offline (it may not have announced yet)."""

    def __init__(self, transport: Transport, grace: WillGrace | None = None) -> None:
        self._transport = transport
        self._grace = grace or WillGrace()
        self._link = link_of(transport)
        self._watched: set[str] = set()
        self._lock = threading.Lock()

    def _watch(self, devices: set[str]) -> None:
        with self._lock:
            new = devices - self._watched
            self._watched |= new
        for device in sorted(new):
            self._transport.subscribe(topics.presence(device), self._on_presence)

    def _on_presence(self, topic: str, payload: bytes) -> None:
        device = topic.rsplit("/", 1)[-1]
        with self._lock:
            if payload.strip() == b"offline":
                self._grace.went_offline(device)
            elif payload.startswith(b"online"):  # back (a reconnection says so again)
                self._grace.came_online(device, incarnation_of(payload))

    def offline(self, devices: Iterable[str], since: float | None = None) -> list[str]:
        """Those of ``devices`` whose latest presence is ``offline``, for longer than the
        grace, and with ``since`` (``time.monotonic()`` when the caller began waiting on them)
        those restarted since, sorted."""
        wanted = set(devices)
        self._watch(wanted)
        with self._lock:
            return self._grace.offline(wanted, self._link(), since)
