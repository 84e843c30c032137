"""Who is offline: every device's retained presence, ``online <node id>`` or its last will
``offline`` (``edgesplit/v1/presence/<device>``).

A device that dies mid-round (killed, or its connection lost past the broker's keepalive) has
its last will published at once by the broker; the agents that wait on it in a round watch
presence so they stop waiting: a GPU server ends a dead sender's part of the round, an edge
gives up a round whose GPU server went offline (:class:`PeerOffline`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from wire import topics
from wire.transport import Transport

__all__ = ["PeerOffline", "PresenceWatch"]


class PeerOffline(RuntimeError):
    """A device this one waited on in a round went offline (its last will arrived)."""

    def __init__(self, round_number: int, devices: Iterable[str], role: str = "GPU server") -> None:
        self.round_number, self.devices = round_number, sorted(devices)
        names = ", ".join(self.devices)
        super().__init__(
            f"round {round_number} given up: {role} {names} went offline (last will) while "
            "this device waited on it"
        )


class PresenceWatch:
    """The devices whose latest presence is ``offline``, followed on ``transport`` for the
    devices asked about: a device's presence topic is subscribed to the first time it is
    asked for (its retained presence arrives then), so an agent hears only the devices it
    waits on, not every device's comings and goings. A device never heard of is not offline
    (it may not have announced yet)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._offline: set[str] = set()
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
                self._offline.add(device)
            elif payload.startswith(b"online"):  # back (a reconnection says so again)
                self._offline.discard(device)

    def offline(self, devices: Iterable[str]) -> list[str]:
        """Those of ``devices`` whose latest presence is ``offline``, sorted."""
        wanted = set(devices)
        self._watch(wanted)
        with self._lock:
            return sorted(wanted & self._offline)
