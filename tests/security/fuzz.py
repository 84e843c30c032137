"""A seeded generator of hostile messages for the fuzz tests: topics of every kind that
``wire.topics`` names (with device slots filled by the attacker's own name and by real
participants'), and payloads from random bytes to damaged envelopes, chunk frames, Flower
messages and JSON with wrong types, NaN, huge numbers and deep nesting.

The same payloads feed the parsers directly (``test_parser_fuzz``) and a real deployment
through the production broker (``test_fuzz``)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import message_to_proto
from flwr.supercore.task_identity import TaskIdentity

from wire import topics
from wire.chunks import CHUNK_MAGIC, split
from wire.codec import Envelope, encode
from wire.flower import array_record
from wire.roles import Announcement, node_id_for

__all__ = ["OWN_KINDS", "TOPIC_KINDS", "Fuzz", "FuzzGenerator"]

# Every topic kind of wire/topics.py, plus shared-subscription-looking and junk topics.
TOPIC_KINDS = (
    "presence",
    "capabilities",
    "servers",
    "act",
    "done",
    "processed",
    "credit",
    "grad",
    "coordinator",
    "flower_in",
    "flower_out",
    "shared",
    "junk",
)
# The kinds of topic a device account may write (its presence, capabilities, activation
# stream, done count and Flower replies, deploy/mosquitto/acl).
OWN_KINDS = ("presence", "capabilities", "act", "done", "flower_out")
_SIZES = (0, 1, 2, 3, 4, 7, 8, 9, 16, 63, 64, 255, 1024, 4095, 65_536, 65_537)
# "__BIG__" becomes a 5,000-digit integer: more digits than Python converts by default
_HUGE = (10**20, 2**63, 2**64 + 1, 10**308, -(2**63) - 1, "__BIG__")


@dataclass(frozen=True)
class Fuzz:
    """One hostile message: where it goes, what it carries, and whether it is retained."""

    kind: str
    topic: str
    payload: bytes
    retain: bool


def _huge_json(value: object) -> str:
    """JSON that Python's encoder will not write: NaN, infinities and 5,000-digit ints."""
    text = json.dumps(value, allow_nan=True).replace('"__NAN__"', "NaN")
    return text.replace('"__BIG__"', "9" * 5000)


def _chunk_parts(frame: bytes) -> tuple[dict[str, object], bytes]:
    length = int.from_bytes(frame[4:8], "little")
    return json.loads(frame[8 : 8 + length]), frame[8 + length :]


def _chunk_frame(header: str, body: bytes) -> bytes:
    raw = header.encode()
    return CHUNK_MAGIC + len(raw).to_bytes(4, "little") + raw + body


class FuzzGenerator:
    """Seeded: the same seed gives the same messages in the same order."""

    def __init__(
        self,
        seed: int,
        run: str,
        names: Sequence[str],
        own: str = "mallory",
        segment: str = "seg-0",
        foreign: float = 0.5,
    ) -> None:
        self.random, self.foreign = random.Random(seed), foreign
        self.run, self.own, self.segment = run, own, segment
        self.names = (own, *names)
        self._valid = self._valid_payloads()
        # (how often, what): oversized payloads are rare, so 10,000 messages stay light
        weighted: tuple[tuple[float, Callable[[], bytes]], ...] = (
            (10, self._random_bytes),
            (3, self._empty),
            (12, self._envelope),
            (8, self._truncated),
            (10, self._bit_flipped),
            (14, self._bad_header),
            (10, self._bad_chunk),
            (12, self._json),
            (8, self._presence),
            (4, self._session),
            (8, self._flower_message),
            (0.5, self._oversized),
        )
        self._weights = [w for w, _ in weighted]
        self._payloads = [p for _, p in weighted]

    # ---------------------------------------------------------------- messages
    def messages(self, count: int) -> Iterator[Fuzz]:
        for _ in range(count):
            yield self.message()

    def message(self) -> Fuzz:
        """A message on one of the attacker's own topics (those a device account may write),
        or with probability ``foreign`` on a topic of any kind."""
        if self.random.random() < self.foreign:
            kind = self.random.choice(TOPIC_KINDS)
            topic = self.topic(kind)
        else:
            kind = self.random.choice(OWN_KINDS)
            topic = self.topic(kind, self.own)
        return Fuzz(kind, topic, self.payload(), self.random.random() < 0.1)

    def topic(self, kind: str, name: str | None = None) -> str:
        """A topic of ``kind`` for device ``name`` (by default the attacker's own name half
        of the time, a participant's otherwise)."""
        rng, run = self.random, self._run()
        if name is None:
            name = self.own if rng.random() < 0.5 else rng.choice(self.names)
        if kind == "presence":
            return topics.presence(name)
        if kind == "capabilities":
            return topics.capabilities(name)
        if kind == "servers":
            return topics.servers(name)
        if kind == "act":
            return topics.activations(run, rng.choice((self.segment, "seg-1", "x")), name)
        if kind in ("done", "processed", "credit"):
            return topics.run_topic(run, kind, name)
        if kind == "grad":
            return topics.gradients(run, name)
        if kind == "coordinator":
            return topics.coordinator(run)
        if kind == "flower_in":
            return topics.flower_in(name)
        if kind == "flower_out":
            return topics.flower_out(name)
        if kind == "shared":
            inner = topics.activations(run, self.segment, name)
            return f"$share/{rng.choice(('gpus', 'x'))}/{inner}"
        return rng.choice(
            (
                f"{topics.PREFIX}/{run}/{self._word()}",
                f"{topics.PREFIX}/{self._word()}",
                f"edgesplit/v2/{run}/act/{self.segment}/{name}",
                f"{self._word()}/{self._word()}",
                f"$SYS/broker/{self._word()}",
                f"{topics.PREFIX}/flower/{name}/in/extra",
                f"{topics.PREFIX}//{run}//",
            )
        )

    def _run(self) -> str:
        return self.run if self.random.random() < 0.9 else self._word()

    def _word(self) -> str:
        return "".join(self.random.choices("abcxyz019-_.", k=self.random.randint(1, 12)))

    # ---------------------------------------------------------------- payloads
    def payload(self) -> bytes:
        return self.random.choices(self._payloads, self._weights)[0]()

    def _random_bytes(self) -> bytes:
        return self.random.randbytes(self.random.choice(_SIZES))

    def _empty(self) -> bytes:
        return b""

    def _envelope(self) -> bytes:
        """A valid envelope of any kind, from any sender, of any round."""
        rng = self.random
        batch = rng.choice((1, 2, 4))
        tensors: dict[str, np.ndarray] = {}
        if rng.random() < 0.7:
            tensors = {
                "x": np.asarray(rng.random() * 10, np.float32) * np.ones((batch, 4), np.float32),
                "y": np.zeros((batch,), np.int64),
            }
        meta: dict[str, object] = {"epoch": rng.choice(("e1", "e2", self._word()))}
        if rng.random() < 0.5:
            meta["batches"] = rng.choice((0, 1, 3, 10**6, -1, 2**40))
        if rng.random() < 0.3:
            meta["counts"] = {rng.choice(self.names): rng.choice((0, 1, 5, -3, 10**9))}
        envelope = Envelope(
            kind=rng.choice(("activations", "round_control", "credit", "gradients")),
            run=self._run(),
            sender=rng.choice(self.names),
            seq=rng.choice((0, 1, rng.randrange(10**6), 2**62)),
            round=rng.choice((0, 1, 2, 3, 10**9)),
            meta=meta,
            tensors=tensors,
        )
        return encode(envelope, rng.choice(("fp32", "fp16", "bf16", "int8")))

    def _valid_payloads(self) -> list[bytes]:
        """A pool of valid messages of every format, for damaging."""
        announcement = Announcement(self.own, "edge", 1 << 20, 1e9, 1e6)
        return [
            *(self._envelope() for _ in range(8)),
            *(self._flower_message() for _ in range(4)),
            announcement.to_json(),
            f"online {node_id_for(self.own)}".encode(),
            b"0000018d2a6c1e00-1a2b3c4d",
        ]

    def _truncated(self) -> bytes:
        data = self.random.choice(self._valid)
        return data[: self.random.randrange(len(data) + 1)]

    def _bit_flipped(self) -> bytes:
        data = bytearray(self.random.choice(self._valid))
        for _ in range(self.random.randint(1, 8)):
            if data:
                data[self.random.randrange(len(data))] ^= 1 << self.random.randrange(8)
        return bytes(data)

    def _bad_value(self) -> object:
        rng = self.random
        return rng.choice(
            (
                None,
                True,
                "",
                "x" * rng.choice((1, 100, 5000)),
                [],
                {},
                [1, [2, [3]]],
                -1,
                0,
                0.5,
                "__NAN__",
                float("inf"),
                float("-inf"),
                rng.choice(_HUGE),
            )
        )

    def _nested(self) -> str:
        depth = self.random.choice((10, 999, 1001, 5000, 30_000))
        return (
            "[" * depth + "]" * depth
            if self.random.random() < 0.5
            else '{"a":' * depth + ("1" + "}" * depth)
        )

    def _bad_header(self) -> bytes:
        """The envelope framing around a damaged JSON header."""
        rng = self.random
        header: dict[str, object] = {
            "kind": "activations",
            "run": self.run,
            "sender": self.own,
            "seq": 1,
            "round": 1,
            "meta": {"epoch": "e1"},
            "tensors": {},
        }
        choice = rng.random()
        if choice < 0.15:
            text = self._nested()
        elif choice < 0.25:
            text = rng.choice(("", "[]", "null", "1", '"x"', "{", "\xff\xfe", "NaN"))
        else:
            for _ in range(rng.randint(1, 3)):
                header[rng.choice((*header, "extra"))] = self._bad_value()
            if rng.random() < 0.3:
                header["tensors"] = {
                    "x": rng.choice(
                        (
                            {"dtype": "float32", "shape": [2, 4], "encoding": "fp32"},
                            {"dtype": "object", "shape": [1], "encoding": "fp32"},
                            {"dtype": "float32", "shape": self._bad_value(), "encoding": "int8"},
                            {"dtype": self._bad_value(), "shape": [], "encoding": "zip"},
                            "x",
                        )
                    )
                }
            text = _huge_json(header)
        raw = text.encode("utf-8", "surrogatepass")
        length = len(raw) if rng.random() < 0.8 else rng.choice((0, 2**32 - 1, len(raw) + 1))
        body = b"" if rng.random() < 0.5 else self._random_bytes()
        return b"ESW1" + length.to_bytes(4, "little") + raw + body

    def _bad_chunk(self) -> bytes:
        """A chunk frame of a real message with its header damaged (or a clean one)."""
        rng = self.random
        frame = rng.choice(self._frames(rng.choice(self._valid) + rng.randbytes(2048)))
        header, body = _chunk_parts(frame)
        if rng.random() < 0.8:
            for _ in range(rng.randint(1, 3)):
                header[rng.choice(("id", "index", "count", "total", "sha256"))] = rng.choice(
                    (self._bad_value(), rng.choice((0, 1, 2, 2**20, 2**20 + 1, 2**31)))
                )
        text = self._nested() if rng.random() < 0.05 else _huge_json(header)
        if rng.random() < 0.1:
            return CHUNK_MAGIC + (2**32 - 1).to_bytes(4, "little") + text.encode()
        return _chunk_frame(text, body)

    def _json(self) -> bytes:
        """An announcement or a task, with some fields replaced by wrong types and numbers."""
        rng = self.random
        record: dict[str, object]
        if rng.random() < 0.5:
            record = {
                "device": rng.choice(self.names),
                "role": rng.choice(("edge", "gpu", "root")),
                "memory": 1 << 20,
                "flops": 1e9,
                "uplink": 1e6,
                "accelerator": "cpu",
                "node_id": node_id_for(rng.choice(self.names)),
            }
        else:
            record = {
                "run": self.run,
                "model": {"name": "cnn", "input_shape": [1, 28, 28]},
                "training": {"rounds": 2, "batch_size": 32},
                "start": 0,
                "end": 2,
                "edges": list(self.names),
            }
        for _ in range(rng.randint(0, 3)):
            record[rng.choice((*record, "extra"))] = self._bad_value()
        if rng.random() < 0.05:
            return self._nested().encode()
        return _huge_json(record).encode()

    def _presence(self) -> bytes:
        rng = self.random
        number = rng.choice(
            (
                str(node_id_for(rng.choice(self.names))),
                "0",
                "-1",
                "1" * rng.choice((20, 5000)),
                "١٢٣",  # Arabic-Indic digits: str.isdigit() says yes
                "",
                "x",
            )
        )
        state = rng.choice(("online", "offline", "ONLINE", "", "online  "))
        return f"{state} {number}".encode() if rng.random() < 0.9 else rng.randbytes(12)

    def _session(self) -> bytes:
        rng = self.random
        return rng.choice(
            (
                b"ffffffffffffffff-ffffffff",
                b"0000000000000000-00000000",
                b"\xff" * 25,
                f"{rng.getrandbits(64):016x}-{rng.getrandbits(32):08x}".encode(),
                b"G" * 25,
            )
        )

    def _flower_message(self) -> bytes:
        """A Flower message (a query, a train or a reply) in chunk frames of 1 KiB."""
        rng = self.random
        saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
        TaskIdentity.run_id, TaskIdentity.task_id = 1, 1
        TaskIdentity.node_id = rng.choice((0, 1, 7))
        try:
            config = ConfigRecord({"server-round": rng.choice((1, 2, -1)), "task": "{}"})
            message = Message(
                RecordDict(
                    {
                        "config": config,
                        "arrays": array_record({"w": np.ones((3,), np.float32)}),
                    }
                ),
                node_id_for(rng.choice(self.names)),
                rng.choice(("train", "query", "evaluate")),
            )
            message.metadata.__dict__["_message_id"] = f"{rng.getrandbits(64):x}"
            if rng.random() < 0.5:
                reply_content = RecordDict(
                    {"metrics": MetricRecord({"num-examples": 1}), "arrays": ArrayRecord()}
                )
                message = Message(reply_content, reply_to=message)
            message.metadata.__dict__.update(_created_at=1.7e9, _ttl=3600.0)  # reproducible
            data = message_to_proto(message).SerializeToString()
        finally:
            TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
        frames = self._frames(data)
        return rng.choice(frames) if len(frames) > 1 and rng.random() < 0.5 else frames[0]

    def _frames(self, data: bytes) -> list[bytes]:
        """``wire.chunks.split`` with a seeded message id instead of a random one."""
        identity = f"{self.random.getrandbits(128):032x}"
        frames = []
        for frame in split(data, 1024):
            header, body = _chunk_parts(frame)
            frames.append(_chunk_frame(json.dumps({**header, "id": identity}), body))
        return frames

    def _oversized(self) -> bytes:
        """Above the parsers' bounds (64 KiB of control JSON or header) but within the
        broker's packet limit; a frame that declares far more than it carries."""
        rng = self.random
        size = rng.choice((65_537, 200_000, 1 << 20))
        if rng.random() < 0.5:
            return b"ESW1" + (size - 8).to_bytes(4, "little") + b"{" + b" " * (size - 9)
        return b'{"device": "' + b"a" * size + b'"}'
