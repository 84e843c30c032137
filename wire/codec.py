"""Envelope codec: a small JSON header plus tensors as safetensors; never pickle.

Layout: ``b"ESW1"``, header length (uint32, little-endian), UTF-8 JSON header, safetensors
bytes. The header names the message kind, run, round, sender, sequence number and, for each
tensor, its logical dtype, shape and wire encoding. Float activations may travel as ``fp16``,
``bf16`` or ``int8`` (per-channel scale along axis 1); :func:`decode` restores them to the
logical dtype. Every decode validates size, header schema, tensor specs and finite values, and
raises :class:`WireError` with a reason tag on the first problem.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from wire.errors import WireError

__all__ = [
    "ENCODINGS",
    "KINDS",
    "MAX_MESSAGE_BYTES",
    "Envelope",
    "TensorSpec",
    "decode",
    "encode",
    "read_header",
]

MAGIC = b"ESW1"
_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
# Assignments, model updates and metrics ride on Flower messages (wire.flower), capabilities
# on JSON announcements (wire.roles): envelopes carry only the stream's own kinds.
KINDS = frozenset({"activations", "gradients", "credit", "round_control"})
ENCODINGS = ("fp32", "fp16", "bf16", "int8")
_LOGICAL = {"float32", "float16", "float64", "int64", "int32", "uint8", "int8", "bool"}
_SCALE = "::scale"
# str(dtype) runs Python code in numpy (about 4 us, several times a message); a dict lookup
# by dtype does not
_NAMES = {np.dtype(n): n for n in (*_LOGICAL, "uint16")}


def _name(dtype: np.dtype[Any]) -> str:
    return _NAMES.get(dtype) or str(dtype)


@dataclass(frozen=True)
class Envelope:
    """One message: routing header, small metadata and named arrays."""

    kind: str
    run: str
    sender: str
    seq: int
    round: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one tensor; ``None`` in ``shape`` matches any size."""

    dtype: str
    shape: tuple[int | None, ...]

    def check(self, name: str, array: np.ndarray) -> None:
        if _name(array.dtype) != self.dtype:
            raise WireError("dtype", f"tensor {name!r} is {array.dtype}, expected {self.dtype}")
        if len(array.shape) != len(self.shape) or any(
            want is not None and want != got
            for want, got in zip(self.shape, array.shape, strict=True)
        ):
            raise WireError(
                "shape",
                f"tensor {name!r} has shape {list(array.shape)}, "
                f"expected {[s if s is not None else '*' for s in self.shape]}",
            )


# ---------------------------------------------------------------- compression


# Compression runs on an edge while, in backprop mode, the batch's forward graph is still held:
# compressing and decompressing each work in one full-size array updated in place (the
# planner's estimate counts it: ``coordinator.plan_config.ENCODE_WORK``), not in the two or
# three a chain of numpy expressions makes.


def _to_bf16(array: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    work = bits >> 16  # the one temporary: round to nearest even
    work &= 1
    work += 0x7FFF
    work += bits
    work >>= 16
    return work.astype(np.uint16)


def _from_bf16(array: np.ndarray) -> np.ndarray:
    bits = array.astype(np.uint32)
    bits <<= 16
    return bits.view(np.float32)


def _int8_axes(array: np.ndarray) -> tuple[int, ...]:
    return tuple(i for i in range(array.ndim) if i != 1) if array.ndim >= 2 else ()


def _to_int8(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.asarray(array, dtype=np.float32)
    axes = _int8_axes(values) or None
    # the largest magnitude per channel, without a full-size copy of |values|
    peak = np.maximum(
        np.max(values, axis=axes, keepdims=True), -np.min(values, axis=axes, keepdims=True)
    )
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    work = np.asarray(values / scale)  # the one temporary (0-d stays an array)
    np.rint(work, out=work)
    np.clip(work, -127, 127, out=work)
    return work.astype(np.int8), np.asarray(scale, dtype=np.float32).reshape(-1)


def _from_int8(quantised: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if quantised.ndim >= 2:
        shape = [1] * quantised.ndim
        shape[1] = -1
        scale = scale.reshape(shape)
    restored: np.ndarray = quantised.astype(np.float32)
    restored *= scale
    return restored


def _wire_arrays(name: str, array: np.ndarray, encoding: str) -> dict[str, np.ndarray]:
    # Row-major first: safetensors writes the buffer in memory order under the logical shape,
    # and ``astype`` keeps the source's layout (a channels-last activation would arrive
    # scrambled, with every value present but in the wrong place).
    if not array.flags.c_contiguous:
        array = np.require(array, requirements="C")  # keeps 0-d arrays 0-d
    if encoding == "fp32" or array.dtype.kind != "f":
        return {name: array}
    if encoding == "fp16":
        return {name: array.astype(np.float16)}
    if encoding == "bf16":
        return {name: _to_bf16(array)}
    quantised, scale = _to_int8(array)
    return {name: quantised, name + _SCALE: scale}


# ---------------------------------------------------------------- encode


def encode(envelope: Envelope, encoding: str = "fp32") -> bytes:
    """Serialise ``envelope``; float tensors travel in ``encoding``."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding: {encoding!r} is not one of {ENCODINGS}")
    if envelope.kind not in KINDS:
        raise ValueError(f"kind: {envelope.kind!r} is not one of {sorted(KINDS)}")
    specs, arrays = {}, {}
    for name, array in envelope.tensors.items():
        if _SCALE in name:
            raise ValueError(f"tensor name {name!r} may not contain {_SCALE!r}")
        used = encoding if array.dtype.kind == "f" else "fp32"
        specs[name] = {"dtype": _name(array.dtype), "shape": list(array.shape), "encoding": used}
        arrays.update(_wire_arrays(name, array, used))
    header = json.dumps(
        {
            "kind": envelope.kind,
            "run": envelope.run,
            "sender": envelope.sender,
            "seq": envelope.seq,
            "round": envelope.round,
            "meta": envelope.meta,
            "tensors": specs,
        },
        separators=(",", ":"),
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    payload = save(arrays) if arrays else b""
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


# ---------------------------------------------------------------- decode


def _header(data: bytes, limit: int) -> tuple[dict[str, Any], int]:
    if len(data) > limit:
        raise WireError("oversize", f"{len(data)} bytes exceeds the limit of {limit}")
    if len(data) < len(MAGIC) + _LENGTH.size or data[: len(MAGIC)] != MAGIC:
        raise WireError("framing", "not an edgesplit envelope (bad magic or truncated)")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise WireError("framing", f"header length {length} does not fit the message")
    try:
        header = json.loads(data[start : start + length])
    # ValueError: bad UTF-8 or JSON, or an integer of over 4,300 digits; RecursionError:
    # arrays or objects nested deeper than the interpreter's recursion limit
    except (ValueError, RecursionError) as error:
        raise WireError("header", f"header is not valid JSON: {error}") from error
    return header, start + length


def read_header(data: bytes) -> dict[str, Any]:
    """What a message's header says, as far as it can be read, for a message that failed
    validation: each routing field (``kind``, ``run``, ``sender``, ``seq``, ``round``, and
    ``epoch`` from ``meta``) that is present with the right type; nothing when the framing or
    the JSON is broken. Fields read here are claims, not validated facts."""
    try:
        header, _ = _header(data[: len(MAGIC) + _LENGTH.size + MAX_HEADER_BYTES], len(data))
    except WireError:
        return {}
    if not isinstance(header, dict):
        return {}
    kinds = {"kind": str, "run": str, "sender": str, "seq": int, "round": int}
    fields = {
        k: v
        for k, kind in kinds.items()
        if isinstance(v := header.get(k), kind) and not isinstance(v, bool)
    }
    meta = header.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("epoch"), str):
        fields["epoch"] = meta["epoch"]
    return fields


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise WireError("header", "header is not an object")
    expected = {
        "kind": str,
        "run": str,
        "sender": str,
        "seq": int,
        "round": int,
        "meta": dict,
        "tensors": dict,
    }
    for key, kind in expected.items():
        value = header.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireError("header", f"field {key!r} missing or not {kind.__name__}")
    if header["kind"] not in KINDS:
        raise WireError("kind", f"unknown message kind {header['kind']!r}")
    if header["seq"] < 0 or header["round"] < 0:
        raise WireError("header", "seq and round must be >= 0")
    unknown = set(header) - set(expected)
    if unknown:
        raise WireError("header", f"unknown header field(s) {sorted(unknown)}")


def _restore(name: str, spec: Any, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    if not isinstance(spec, dict) or {"dtype", "shape", "encoding"} - set(spec):
        raise WireError("header", f"tensor {name!r} has a malformed spec")
    encoding, dtype = spec["encoding"], spec["dtype"]
    if encoding not in ENCODINGS or dtype not in _LOGICAL:
        raise WireError("dtype", f"tensor {name!r}: encoding {encoding!r} / dtype {dtype!r}")
    if name not in arrays:
        raise WireError("payload", f"tensor {name!r} is missing from the payload")
    raw = arrays[name]
    wire_dtype = {"fp32": dtype, "fp16": "float16", "bf16": "uint16", "int8": "int8"}[encoding]
    if _name(raw.dtype) != wire_dtype:
        raise WireError(
            "dtype", f"tensor {name!r} travels as {raw.dtype}, header says {wire_dtype}"
        )
    if encoding == "fp32":
        restored = raw
    elif encoding == "fp16":
        restored = raw.astype(dtype)
    elif encoding == "bf16":
        restored = _from_bf16(raw).astype(dtype, copy=False)
    else:
        scale = arrays.get(name + _SCALE)
        if scale is None or scale.dtype != np.float32 or not np.all(np.isfinite(scale)):
            raise WireError("payload", f"tensor {name!r} has no valid int8 scale")
        expected = raw.shape[1] if raw.ndim >= 2 else 1
        if scale.shape != (expected,):
            raise WireError("shape", f"tensor {name!r}: scale shape {scale.shape}")
        restored = _from_int8(raw, scale).astype(dtype, copy=False)
    if list(restored.shape) != spec["shape"]:
        raise WireError(
            "shape",
            f"tensor {name!r} has shape {list(restored.shape)}, header says {spec['shape']}",
        )
    if restored.dtype.kind == "f" and not np.all(np.isfinite(restored)):
        raise WireError("non_finite", f"tensor {name!r} contains NaN or infinity")
    return restored


def decode(
    data: bytes,
    expect: Mapping[str, TensorSpec] | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Envelope:
    """Parse and validate ``data``; with ``expect``, tensor names, dtypes and shapes must match."""
    header, offset = _header(data, max_bytes)
    _check_header(header)
    specs: dict[str, Any] = header["tensors"]
    arrays: dict[str, np.ndarray] = {}
    if specs:
        try:
            arrays = load(bytes(data[offset:]))
        except Exception as error:  # safetensors raises its own error types
            raise WireError("payload", f"tensor payload is unreadable: {error}") from error
    elif len(data) > offset:
        raise WireError("payload", "payload bytes without tensor specs")
    extra = set(arrays) - set(specs) - {n + _SCALE for n in specs}
    if extra:
        raise WireError("payload", f"payload has undeclared tensors {sorted(extra)}")
    tensors = {name: _restore(name, spec, arrays) for name, spec in specs.items()}
    if expect is not None:
        if set(tensors) != set(expect):
            raise WireError("payload", f"tensors {sorted(tensors)}, expected {sorted(expect)}")
        for name, want in expect.items():
            want.check(name, tensors[name])
    return Envelope(
        header["kind"],
        header["run"],
        header["sender"],
        header["seq"],
        header["round"],
        header["meta"],
        tensors,
    )
