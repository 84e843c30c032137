"""The control protocol shared by the three roles: who a device is, what it can do, and what a
round asks of it.

- A device's Flower node id is derived from its name (:func:`node_id_for`), so a restarted agent
  keeps its identity and a restarted coordinator recognises it.
- An agent announces itself with a retained :class:`Announcement` on
  ``edgesplit/v1/capabilities/<device>`` (an edge) or ``edgesplit/v1/servers/<device>`` (a GPU
  server, a topic only the servers' account may write); its Flower node presence (retained
  ``online``, last will ``offline``) tells whether it is alive.
- Every ``train`` (and ``query``) message carries a :class:`Task` as JSON in its config record:
  the run's model and training sections, the blocks the device trains and its streams. Agents
  keep no assignment state of their own; a restarted agent is ready for the next round it is
  sent.

Every inbound announcement and task is validated; a bad one raises :class:`WireError`.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from wire.errors import RefusedError, TransportError, WireError
from wire.topics import announcement as announcement_topic
from wire.topics import check_name
from wire.transport import Transport

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

    from wire.flower import FlowerNode

__all__ = ["ROLES", "Announcement", "Task", "go_online", "node_id_for"]

ROLES = ("edge", "gpu")
MAX_CONTROL_BYTES = 64 * 1024
MAX_SECTION_BYTES = 8 * 1024  # one section of a task (model, training), as JSON
MAX_SECTION_KEYS = 64
_SCALARS = (str, int, float, bool)


def node_id_for(device: str) -> int:
    """A stable Flower node id for ``device`` (1 .. 2**63 - 1): 63 bits of its name's hash,
    so two of even a million names share one with a chance of about 1e-7 (a 31-bit CRC gave
    2 % at ten thousand random names); the coordinator's grid refuses a second name on an id
    it already knows rather than mixing their messages."""
    digest = hashlib.blake2b(check_name(device, "device").encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**63 - 1) + 1


def _loads(payload: bytes | str, what: str) -> dict[str, Any]:
    if len(payload) > MAX_CONTROL_BYTES:
        raise WireError("size", f"{what} of {len(payload)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError) as error:  # as in wire.codec._header
        raise WireError("json", f"{what} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise WireError("json", f"{what} must be a JSON object")
    return data


def _number(
    data: Mapping[str, Any],
    key: str,
    what: str,
    *,
    optional: bool = False,
    least: float = 0.0,
    most: float = 2.0**53,
) -> Any:
    """``data[key]``: a finite number above 0 (at least ``least`` when given) and at most
    ``most`` (a device declaring 1e20 bytes of memory lies, and no store's integer holds it)."""
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError("field", f"{what}.{key}: expected a finite number, got {value!r}")
    if value <= 0 or value < least:
        bound = f"at least {least:g}" if least else "positive"
        raise WireError("field", f"{what}.{key}: must be {bound}, got {value!r}")
    if value > most:
        raise WireError("field", f"{what}.{key}: must be at most {most:g}, got {value!r}")
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
    # an edge's local training examples: the planner spreads the round's weight traffic
    # over the batches they make (None: unknown, not counted)
    examples: int | None = None

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
            # a device of a few FLOP/s or bytes/s is not one: such a rate makes the plan's times
            # overflow (1 FLOP/s and 1 byte/s still plan, as hopeless devices)
            flops=float(_number(data, "flops", "announcement", least=1.0, most=1e21)),
            uplink=_number(data, "uplink", "announcement", optional=True, least=1.0),
            accelerator=accelerator,
            examples=_examples(data),
        )


def _examples(data: Mapping[str, Any]) -> int | None:
    """An announcement's ``examples``: absent, or a count below 2**40."""
    value = data.get("examples")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 40:
        raise WireError("field", f"announcement.examples: expected a count, got {value!r}")
    return value


def _section(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A run section (``model``, ``training``) as it travels: a JSON object of bounded size
    whose keys are names and whose values are plain data, nested at most one object deep.
    What the values mean is the agent's to check (``split_models.config`` parses them)."""
    value = data.get(key)
    where = f"task.{key}"
    if not isinstance(value, dict):
        raise WireError("field", f"{where}: expected a JSON object, got {type(value).__name__}")
    size = len(json.dumps(value))
    if size > MAX_SECTION_BYTES:
        raise WireError(
            "size", f"{where}: {size} bytes exceeds {MAX_SECTION_BYTES}; send only the section"
        )
    _check_object(value, where, depth=0)
    return value


def _check_object(value: Mapping[Any, Any], where: str, depth: int) -> None:
    if len(value) > MAX_SECTION_KEYS:
        raise WireError(
            "field", f"{where}: {len(value)} keys exceeds {MAX_SECTION_KEYS} for a section"
        )
    for name, item in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise WireError("field", f"{where}: keys are names of 1-64 characters, got {name!r}")
        path = f"{where}.{name}"
        if isinstance(item, dict):
            if depth >= 1:
                raise WireError("field", f"{path}: sections nest one object deep at most")
            _check_object(item, path, depth + 1)
        elif isinstance(item, list):
            if not all(_plain(element) for element in item):
                raise WireError("field", f"{path}: expected a list of plain values, got {item!r}")
        elif not _plain(item):
            raise WireError("field", f"{path}: expected a plain value, got {item!r}")


def _plain(value: object) -> bool:
    """A JSON scalar: null, a boolean, a string or a finite number."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, _SCALARS)


def _names(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise WireError("field", f"task.{key}: expected a list of device names, got {value!r}")
    for name in value:
        try:
            check_name(name, f"task.{key}")
        except ValueError as error:
            raise WireError("field", str(error)) from error
    return tuple(value)


def _stream_name(data: Mapping[str, Any], key: str, optional: bool) -> str | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise WireError(
            "field", f"task.{key}: expected a stream name such as 'seg-0', got {value!r}"
        )
    try:
        return check_name(value, f"task.{key}")
    except ValueError as error:
        raise WireError("field", str(error)) from error


MAX_BLOCKS = 100_000  # block indices a task may name
MAX_ESTIMATE_BYTES = 1 << 50


def _count(data: Mapping[str, Any], key: str, maximum: int = MAX_BLOCKS) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise WireError(
            "field", f"task.{key}: expected an integer in [0, {maximum:,}], got {value!r}"
        )
    return value


@dataclass(frozen=True)
class Task:
    """What a round asks of one device (JSON in the config record's ``task`` entry).

    ``model`` and ``training`` are the run's sections as plain data (``ModelConfig`` and
    ``TrainingConfig`` written by ``split_models.config.config_to_dict``): the agent parses them
    with ``split_models.config``. The rest is the device's own: blocks ``[start, end)`` (an edge
    trains them with a local head, a server is a piece of the back), the memory estimate, the
    stream it feeds or serves (``segment``), a server's senders (``edges``), the peers sharing
    its piece (``servers``; for an edge, the servers of the stream it feeds, whose presence
    it watches), the next piece's stream (``forward``) and the coordinator's
    ``session``.
    """

    run: str
    model: dict[str, Any]
    training: dict[str, Any]
    start: int
    end: int
    estimated_peak_bytes: int = 0
    segment: str = "seg-0"
    edges: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    forward: str | None = None
    session: str | None = None

    def segment_key(self) -> str:
        """What a built segment depends on: the model, the blocks, whether it ends in a head
        that passes its output on, and the training settings that shape it (optimizer, local
        loss, mode). Not the run's bookkeeping (session, deadline, estimate, streams) nor a
        round's weights: tasks with one key can train one built segment."""
        shaping = {k: self.training.get(k) for k in ("optimizer", "local_loss", "mode")}
        key = {
            "model": self.model,
            "blocks": [self.start, self.end],
            "passes_on": self.forward is not None,
            "training": shaping,
        }
        return json.dumps(key, sort_keys=True)

    def to_json(self) -> str:
        # fields shallowly: asdict deep-copies the model and training sections, which cost a
        # coordinator of 1,000 clients more than the rest of building their messages
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["edges"], data["servers"] = list(self.edges), list(self.servers)
        return json.dumps(data)

    @classmethod
    def parse(cls, text: str | bytes) -> Task:
        """The task of ``text``; raises ``WireError`` naming the bad field. The last texts
        seen are parsed once: a host of many clients gets the same task for all clients of a
        cut, every round (a task is immutable; its sections are read, never changed)."""
        return _parsed_task(text)

    @classmethod
    def _parse(cls, text: str | bytes) -> Task:
        data = _loads(text, "task")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise WireError("field", f"task: unknown key(s) {unknown}")
        run = data.get("run")
        if not isinstance(run, str):
            raise WireError("field", f"task.run: expected a run name, got {run!r}")
        try:
            check_name(run, "task.run")
        except ValueError as error:
            raise WireError("field", str(error)) from error
        start, end = _count(data, "start"), _count(data, "end")
        if not start < end:
            raise WireError("field", f"task: blocks [{start}, {end}) are empty; need start < end")
        session = data.get("session")
        if session is not None and not isinstance(session, str):
            raise WireError("field", f"task.session: expected a string, got {session!r}")
        estimate = "estimated_peak_bytes" in data
        return cls(
            run=run,
            model=_section(data, "model"),
            training=_section(data, "training"),
            start=start,
            end=end,
            estimated_peak_bytes=(
                _count(data, "estimated_peak_bytes", MAX_ESTIMATE_BYTES) if estimate else 0
            ),
            segment=_stream_name(data, "segment", True) or "seg-0",
            edges=_names(data, "edges"),
            servers=_names(data, "servers"),
            forward=_stream_name(data, "forward", True),
            session=session,
        )


@functools.lru_cache(maxsize=64)
def _parsed_task(text: str | bytes) -> Task:
    return Task._parse(text)


def go_online(announcement: Announcement, control: Transport, app: ClientApp) -> FlowerNode:
    """Make an agent reachable: its Flower node (presence ``online``) and its retained
    capabilities, both said again after every reconnection (a broker restarted without
    persistence forgets retained messages)."""
    from wire.flower import FlowerNode

    before = collections.Counter(getattr(control, "refused", ()))
    node = FlowerNode(control, announcement.node_id, app, name=announcement.device)

    def announce() -> None:
        topic = announcement_topic(announcement.device, announcement.role)
        control.publish(topic, announcement.to_json(), retain=True)

    announce()
    _check_accepted(control, announcement.device, before)
    control.on_reconnect(announce)
    return node


# what an ACL answers a device that writes under another's name
_DENIALS = ("Not authorized", "Topic name invalid")


def _check_accepted(control: Transport, device: str, before: collections.Counter[str]) -> None:
    """:class:`RefusedError` when the broker refused what ``device`` said of itself (an ACL
    lets a device account write only under its own name; ``before``: the transport's
    refusals before): it could take no part, and would only retry for good."""
    if not hasattr(control, "refused"):  # no acknowledgements (in-process): nothing to ask
        return
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not _denied(control, before):
        try:  # until the broker acknowledged what was said, or refused some of it
            control.flush(0.2)
            break
        except TransportError:
            continue
    if refused := _denied(control, before):
        account = getattr(getattr(control, "config", None), "username", None)
        raise RefusedError(
            f"the broker refused {device!r}'s announcement ({', '.join(sorted(refused))}) "
            f"under account {account!r}: a device account may write only under its own "
            f"name, so give --id the account's name or connect with {device!r}'s account"
        )


def _denied(control: Transport, before: collections.Counter[str]) -> collections.Counter[str]:
    """The refusals an ACL gives since ``before`` ("Not authorized", "Topic name invalid"; a
    full quota or a busy broker is no reason to stop), read from a copy: the network thread
    counts into ``control.refused`` meanwhile."""
    now = collections.Counter(getattr(control, "refused", ())) - before
    return collections.Counter({k: v for k, v in now.items() if k in _DENIALS})
