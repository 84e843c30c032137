"""The control protocol shared by the three roles: who a device is, what it can do, and what a
round asks of it.

- A device's Flower node id is derived from its name (:func:`node_id_for`), so a restarted agent
  keeps its identity and a restarted coordinator recognises it.
- An agent announces itself with a retained :class:`Announcement` on
  ``edgesplit/v1/capabilities/<device>``; its Flower node presence (retained ``online``, last
  will ``offline``) tells whether it is alive.
- Every ``train`` (and ``query``) message carries a :class:`Task` as JSON in its config record:
  the model, the blocks the device trains, the optimizer and the round's deadline. Agents keep no
  assignment state of their own; a restarted agent is ready for the next round it is sent.

Every inbound announcement and task is validated; a bad one raises :class:`WireError`.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from wire.errors import WireError
from wire.topics import capabilities, check_name
from wire.transport import Transport

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

    from wire.flower import FlowerNode

__all__ = ["ROLES", "Announcement", "Task", "go_online", "node_id_for"]

ROLES = ("edge", "gpu")
MAX_CONTROL_BYTES = 64 * 1024


def node_id_for(device: str) -> int:
    """A stable Flower node id for ``device`` (1 .. 2**31 - 1)."""
    return zlib.crc32(check_name(device, "device").encode()) % (2**31 - 1) + 1


def _loads(payload: bytes | str, what: str) -> dict[str, Any]:
    if len(payload) > MAX_CONTROL_BYTES:
        raise WireError("size", f"{what} of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as error:
        raise WireError("json", f"{what} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise WireError("json", f"{what} must be a JSON object")
    return data


def _number(data: Mapping[str, Any], key: str, what: str, *, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError("field", f"{what}.{key}: expected a finite number, got {value!r}")
    if value <= 0:
        raise WireError("field", f"{what}.{key}: must be positive, got {value!r}")
    return value


@dataclass(frozen=True)
class Announcement:
    """What an agent declares about itself: memory for training in bytes, FLOP/s, uplink
    bytes/s (edges), and the accelerator it trains on."""

    device: str
    role: str
    memory: int
    flops: float
    uplink: float | None = None
    accelerator: str = "cpu"

    @property
    def node_id(self) -> int:
        return node_id_for(self.device)

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "node_id": self.node_id}).encode()

    @classmethod
    def parse(cls, payload: bytes) -> Announcement:
        data = _loads(payload, "announcement")
        device, role = data.get("device"), data.get("role")
        if not isinstance(device, str):
            raise WireError("field", "announcement.device: expected a device name")
        try:
            check_name(device, "device")
        except ValueError as error:
            raise WireError("field", f"announcement.device: {error}") from error
        if role not in ROLES:
            raise WireError("field", f"announcement.role: expected one of {ROLES}, got {role!r}")
        if data.get("node_id") != node_id_for(device):
            raise WireError("field", f"announcement.node_id does not belong to {device!r}")
        accelerator = data.get("accelerator", "cpu")
        if not isinstance(accelerator, str):
            raise WireError("field", "announcement.accelerator: expected a string")
        return cls(
            device=device,
            role=str(role),
            memory=int(_number(data, "memory", "announcement")),
            flops=float(_number(data, "flops", "announcement")),
            uplink=_number(data, "uplink", "announcement", optional=True),
            accelerator=accelerator,
        )


@dataclass(frozen=True)
class Task:
    """What a round asks of one device (JSON in the config record's ``task`` entry)."""

    run: str
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    start: int
    end: int  # the edge trains [start, end) with a local head; a server [start, N)
    batch_size: int
    local_epochs: int
    optimizer: dict[str, Any]
    local_loss: str
    mode: str
    compression: str
    seed: int
    deadline_seconds: float
    estimated_peak_bytes: int = 0
    edges: tuple[str, ...] = ()  # servers: the edges whose streams this round trains
    segment: str = "seg-0"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def session(self) -> str | None:
        """The session of the coordinator that asked for this task (``wire.session``)."""
        session = self.extra.get("session")
        return None if session is None else str(session)

    def to_json(self) -> str:
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        data["edges"] = list(self.edges)
        return json.dumps(data)

    @classmethod
    def parse(cls, text: str | bytes) -> Task:
        data = _loads(text, "task")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise WireError("field", f"task: unknown key(s) {unknown}")
        try:
            task = cls(**data)
        except TypeError as error:
            raise WireError("field", f"task: {error}") from error
        shape = data["input_shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise WireError("field", f"task.input_shape: expected positive sizes, got {shape!r}")
        ints = ("num_classes", "start", "end", "batch_size", "local_epochs", "seed")
        for key in ints:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise WireError("field", f"task.{key}: expected an integer >= 0, got {value!r}")
        if not 0 <= task.start < task.end:
            raise WireError("field", f"task: blocks [{task.start}, {task.end}) are empty")
        _number(data, "deadline_seconds", "task")
        edges = data.get("edges", [])
        if not isinstance(edges, list) or not all(isinstance(e, str) for e in edges):
            raise WireError("field", "task.edges: expected a list of device names")
        check_name(task.run, "run")
        return cls(**{**data, "input_shape": tuple(shape), "edges": tuple(edges)})


def go_online(announcement: Announcement, control: Transport, app: ClientApp) -> FlowerNode:
    """Make an agent reachable: its Flower node (presence ``online``) and its retained
    capabilities, both said again after every reconnection (a broker restarted without
    persistence forgets retained messages)."""
    from wire.flower import FlowerNode

    node = FlowerNode(control, announcement.node_id, app, name=announcement.device)

    def announce() -> None:
        control.publish(capabilities(announcement.device), announcement.to_json(), retain=True)

    announce()
    control.on_reconnect(announce)
    return node
