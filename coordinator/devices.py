"""The devices a coordinator knows: their retained announcements and who is online (a will
counted after its grace, :class:`GracefulNodes`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from flwr.serverapp import Grid

from coordinator.config import DevicesConfig
from coordinator.errors import CoordinatorError
from storage.base import RunStore
from storage.records import DeviceRecord
from wire import topics
from wire.errors import WireError
from wire.flower import TransportGrid
from wire.logs import warn
from wire.presence import WillGrace, link_of
from wire.roles import Announcement
from wire.transport import Transport

__all__ = ["DeviceRegistry", "GracefulNodes", "record_devices"]

log = logging.getLogger(__name__)
_POLL = 0.1
_TELL_EVERY = 10.0  # seconds between "waiting for devices" lines


class DeviceRegistry:
    """Announcements heard on ``capabilities/+`` (edges) and ``servers/+`` (GPU servers), and
    the grid's online Flower nodes."""

    def __init__(
        self,
        transport: Transport,
        grid: TransportGrid,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid, self._clock, self._sleep = grid, clock, sleep
        self._announcements: dict[str, Announcement] = {}
        self._lock = threading.Lock()
        transport.subscribe(f"{topics.PREFIX}/capabilities/+", self._on_announcement)
        transport.subscribe(f"{topics.PREFIX}/servers/+", self._on_announcement)

    def _on_announcement(self, topic: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared retained message
        try:
            announcement = Announcement.parse(payload)
        except WireError as error:
            warn(log, topic, "ignored a bad device announcement on %s: %s", topic, error)
            return
        named = topic.rsplit("/", 1)[1]
        if announcement.device != named:  # a device speaks for itself only (ACL: %u)
            log.warning(
                "ignored an announcement of %r on the capabilities topic of %r",
                announcement.device,
                named,
            )
            return
        if topic != topics.announcement(named, announcement.role):  # the ACL binds the role
            log.warning(
                "ignored %r announcing the role %r on %s: a GPU server announces on %s",
                named,
                announcement.role,
                topic,
                topics.servers(named),
            )
            return
        with self._lock:
            self._announcements[announcement.device] = announcement

    def online(self, role: str | None = None) -> dict[str, Announcement]:
        """Announced devices whose Flower node is online, by name."""
        nodes = set(self.grid.get_node_ids())
        with self._lock:
            return {
                name: a
                for name, a in sorted(self._announcements.items())
                if a.node_id in nodes and (role is None or a.role == role)
            }

    def missing(self, declared: DevicesConfig) -> list[str]:
        """What keeps ``declared`` from being online, one phrase per device or count."""
        return [
            *self._missing(self.online("edge"), declared.edges, "edge(s)"),
            *self._missing(self.online("gpu"), declared.gpu_servers, "GPU server(s)"),
        ]

    def _missing(
        self, online: dict[str, Announcement], wanted: int | tuple[str, ...], kind: str
    ) -> list[str]:
        if isinstance(wanted, tuple):
            with self._lock:
                known = set(self._announcements)
            return [
                f"{name} ({'offline' if name in known else 'never announced'})"
                for name in wanted
                if name not in online
            ]
        if len(online) < wanted:
            have = ", ".join(online) or "none"
            return [f"{wanted - len(online)} more {kind}; {kind} online: {have}"]
        return []

    def wait(self, declared: DevicesConfig) -> tuple[list[Announcement], list[Announcement]]:
        """The edges and GPU servers to plan with, once all ``declared`` ones are online: the
        named ones, or the first by name."""
        deadline = self._clock() + declared.wait_seconds
        # first said after 2 s: the retained announcements of devices online arrive first
        told = self._clock() - _TELL_EVERY + 2.0
        while missing := self.missing(declared):
            now = self._clock()
            if now >= deadline:
                raise CoordinatorError(
                    f"waited {declared.wait_seconds:.0f} s for the devices; missing: "
                    f"{'; '.join(missing)} (start them, or raise devices.wait)"
                )
            if now - told > _TELL_EVERY:
                log.info("waiting for devices: %s", "; ".join(missing))
                told = now
            self._sleep(_POLL)
        edges = _chosen(self.online("edge"), declared.edges)
        return edges, _chosen(self.online("gpu"), declared.gpu_servers)


def _chosen(online: dict[str, Announcement], wanted: int | tuple[str, ...]) -> list[Announcement]:
    """The ``wanted`` devices (names) of those ``online``, or the first ``wanted`` of them."""
    if isinstance(wanted, tuple):
        return [online[name] for name in wanted]
    return list(online.values())[:wanted]


def record_devices(store: RunStore, devices: list[Announcement]) -> None:
    """Store ``devices`` as online with what they announced."""
    for device in devices:
        store.upsert_device(
            DeviceRecord(
                device.device,
                device.role,
                device.memory,
                device.flops,
                device.uplink,
                status="online",
            )
        )


class GracefulNodes:
    """The grid's online nodes as the runner judges a try by: a node whose will arrived counts
    online until :class:`~wire.presence.WillGrace` says the will counts (a broker restarting
    publishes every will, and this process receives the queued ones after its own reconnect,
    before the devices are back)."""

    def __init__(self, grid: Grid, transport: object = None, grace: WillGrace | None = None):
        self._grid, self._grace = grid, grace or WillGrace()
        self._link = link_of(transport)
        self._known: set[int] = set()
        self._present: set[int] = set()  # as of the last call

    def __call__(self) -> set[int]:
        present = set(self._grid.get_node_ids())
        # only the nodes that came or went since the last call (a loop over every node on
        # each poll cost a round of 1,000 clients seconds)
        for node in self._present - present:
            self._grace.went_offline(str(node))
        for node in present - self._present:
            self._grace.came_online(str(node))
        self._present = present
        self._known |= present
        absent = [str(n) for n in self._known - present]
        return self._known - {int(n) for n in self._grace.offline(absent, self._link())}
