"""Typed configuration: frozen dataclasses parsed and written by one field-driven parser.

Every configuration of edgesplit (the run's ``coordinator.config.RunConfig``, the simulation's
``simulation.config.SimConfig``) is a tree of frozen dataclasses, one section per component
(model, data, devices, training, aggregation, ...). Each field holds its one default and, in
its metadata (``setting(...)``), what the parser checks: integer minimums, number ranges,
choices, durations (``30s``, ``5m``, numbers of seconds), memory sizes (``16MiB``), names.
``parse_config`` reads a mapping into a section (unknown keys rejected by name, missing ones
named, every error a ``ConfigError`` naming the key, the bad value and the valid options);
``config_to_dict`` writes a section back as plain JSON-able data that ``parse_config`` reads
to an equal object.

**Flat files.** A section marked ``flat`` has its keys at the level of its parent: RUN.yaml
stays the flat file it always was (``batch_size: 32``, not ``training: {batch_size: 32}``), each
key owned by exactly one section, and ``to_dict`` writes the same flat keys, so stored configs
and the files users wrote keep parsing and comparing key by key. ``aliases`` name keys older
versions wrote (``round_deadline_seconds``), accepted on reading, never written.

This module also holds the sections every role shares, so that they can travel to devices as
they are: ``ModelConfig`` (which network) and ``TrainingConfig`` (how each round trains).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from split_models.errors import ConfigError
from split_models.options import (
    INPUT_DTYPE_NAMES,
    LOCAL_LOSSES,
    TASKS,
    ModelOptions,
    OptimizerConfig,
)
from split_models.units import parse_bandwidth, parse_duration, parse_flops, parse_memory
from wire.codec import ENCODINGS
from wire.topics import check_name

if TYPE_CHECKING:
    from split_models.zoo import SplittableModel

__all__ = [
    "MODES",
    "NORMS",
    "ModelConfig",
    "TrainingConfig",
    "config_keys",
    "config_to_dict",
    "default_of",
    "parse_config",
    "parse_duration",
    "setting",
    "stored_section",
]

MODES = ("local-loss", "backprop")
# How BatchNorm layers aggregate: averaged like every other tensor (FedAvg), kept by each
# device as its own (FedBN: every device trains and evaluates with its own normalization), or
# averaged and their running statistics then measured anew by the edges on the aggregate.
NORMS = ("average", "local", "recalibrate")
# Bounds on what a config (or a task from the network) may ask for: a device must be able to
# refuse an absurd request by name instead of waiting, allocating or looping for ever (and
# split_models.units.MAX_DURATION_SECONDS).
MAX_SAMPLE_ELEMENTS = 1 << 26  # values per sample (a 3x4096x4096 image is 50 M)
_EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")  # PyYAML reads 1e8 as text
_ABSENT = object()
T = TypeVar("T")


def setting(
    default: Any = MISSING,
    *,
    factory: Callable[[], Any] | Any = MISSING,
    key: str | None = None,
    aliases: tuple[str, ...] = (),
    kind: str | None = None,
    what: str | None = None,
    minimum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[object, str], Any] | None = None,
    dump: Callable[[Any], Any] | None = None,
    flat: bool = False,
) -> Any:
    """A configuration field: its default and what the parser checks.

    ``key`` is the name in the file (default: the field's name); ``kind`` one of ``int``,
    ``number``, ``text``, ``choice``, ``bool``, ``duration``, ``memory``, ``flops``,
    ``bandwidth``, ``name``, ``shape``, ``mapping`` (default: from the field's type);
    ``what`` the expectation named in errors; ``parse``/``dump`` a custom reader and writer;
    ``flat`` a section whose keys sit beside its parent's.
    """
    metadata = {
        "key": key,
        "aliases": aliases,
        "kind": kind,
        "what": what,
        "minimum": minimum,
        "above": above,
        "below": below,
        "maximum": maximum,
        "choices": choices,
        "parse": parse,
        "dump": dump,
        "flat": flat,
    }
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _key(spec: dataclasses.Field[Any]) -> str:
    return str(spec.metadata.get("key") or spec.name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_type(cls: type, spec: dataclasses.Field[Any]) -> type | None:
    hint = _hints(cls)[spec.name]
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a configuration dataclass")
    return dataclasses.fields(cls)


def config_keys(cls: type, exclude: frozenset[str] = frozenset()) -> set[str]:
    """Every key a mapping for ``cls`` may hold (flat sections' keys, aliases included)."""
    keys: set[str] = set()
    for spec in dataclasses.fields(cls):
        section = _section_type(cls, spec)
        if spec.metadata.get("flat") and section is not None:
            keys |= config_keys(section, exclude)
        elif _key(spec) not in exclude:
            keys |= {_key(spec), *spec.metadata.get("aliases", ())}
    return keys


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of ``cls`` (the one place it is written)."""
    for spec in dataclasses.fields(cls):
        if spec.name == name:
            if spec.default is not MISSING:
                return spec.default
            if spec.default_factory is not MISSING:
                return spec.default_factory()
            raise TypeError(f"{cls.__name__}.{name} has no default; it must be given")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


def _mapping(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    return data


def _lookup(data: Mapping[str, Any], spec: dataclasses.Field[Any]) -> Any:
    for key in (_key(spec), *spec.metadata.get("aliases", ())):
        if key in data:
            return data[key]
    return _ABSENT


def parse_config(
    cls: type[T],
    data: object,
    where: str = "config",
    base: T | None = None,
    exclude: frozenset[str] = frozenset(),
    prefix: str = "",
) -> T:
    """Read ``data`` into the dataclass ``cls``; absent keys take ``base``'s values (when
    given) or the fields' defaults; keys in ``exclude`` are not accepted (they keep those).
    ``where`` names the mapping in errors, ``prefix`` goes before each key's name in them."""
    mapping = _mapping(data, where)
    valid = config_keys(cls, exclude)
    unknown = sorted(set(mapping) - valid)
    if unknown:
        from split_models.config_hints import unknown_keys

        raise unknown_keys(cls, where, unknown, valid)
    values: dict[str, Any] = {}
    missing: list[str] = []
    for spec in _fields(cls):
        if spec.init:
            _parse_field(cls, spec, mapping, (where, prefix), base, exclude, values, missing)
    if missing:
        raise ConfigError(f"{where}: missing key(s) {sorted(missing)}")
    try:
        return cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from error


def _parse_field(
    cls: type,
    spec: dataclasses.Field[Any],
    mapping: Mapping[str, Any],
    place: tuple[str, str],
    base: object,
    exclude: frozenset[str],
    values: dict[str, Any],
    missing: list[str],
) -> None:
    where, prefix = place
    section = _section_type(cls, spec)
    inherited = getattr(base, spec.name) if base is not None else _ABSENT
    if spec.metadata.get("flat") and section is not None:
        own = config_keys(section, exclude)
        subset = {k: v for k, v in mapping.items() if k in own}
        child = None if inherited is _ABSENT else inherited
        values[spec.name] = parse_config(section, subset, where, child, exclude, prefix)
        return
    value = _ABSENT if _key(spec) in exclude else _lookup(mapping, spec)
    if value is _ABSENT:
        if inherited is not _ABSENT:
            values[spec.name] = inherited
        elif spec.default is MISSING and spec.default_factory is MISSING:
            missing.append(_key(spec))
        return
    path = prefix + _key(spec)
    if spec.metadata.get("parse") is not None:
        values[spec.name] = spec.metadata["parse"](value, path)
    elif section is not None:
        values[spec.name] = parse_config(section, value, path, prefix=path + ".")
    else:
        values[spec.name] = _convert(spec, _hints(cls)[spec.name], value, path)


def stored_section(cls: type[T], data: object, where: str = "stored config") -> T:
    """The section ``cls`` of a whole flat config (a stored run's, or a simulation's): its own
    keys are read, the other sections' are left to their readers."""
    own = config_keys(cls)
    mapping = _mapping(data, where)
    return parse_config(cls, {k: v for k, v in mapping.items() if k in own}, where)


def _kind(spec: dataclasses.Field[Any], hint: Any) -> str:
    kind = spec.metadata.get("kind")
    if kind:
        return str(kind)
    if spec.metadata.get("choices"):
        return "choice"
    for name, tested in (("bool", bool), ("int", int), ("number", float), ("text", str)):
        if hint is tested or (hint == tested | None):
            return name
    raise TypeError(f"field {spec.name}: no parser for type {hint!r}; give setting(kind=...)")


def _convert(spec: dataclasses.Field[Any], hint: Any, value: object, path: str) -> Any:
    if value is None and (spec.default is None or type(None) in typing.get_args(hint)):
        return None  # an optional setting turned off
    meta = spec.metadata
    kind = _kind(spec, hint)
    if kind in _UNITS:
        return _UNITS[kind](value, path)
    if kind == "choice":
        if value not in meta["choices"]:
            raise ConfigError(f"{path}: {value!r} is not one of {list(meta['choices'])}")
        return str(value)
    if kind in ("int", "number"):
        return _number(kind, meta, value, path)
    checks = {
        "bool": isinstance(value, bool),
        "text": isinstance(value, str) and bool(value),
        "mapping": isinstance(value, Mapping),
    }
    if not checks.get(kind, False):
        what = meta.get("what") or {"bool": "true or false", "mapping": "a mapping"}.get(
            kind, "a non-empty string"
        )
        raise ConfigError(f"{path}: expected {what}, got {value!r}")
    return dict(value) if isinstance(value, Mapping) else value


def _number(kind: str, meta: Mapping[str, Any], value: object, path: str) -> int | float:
    low, above = meta.get("minimum"), meta.get("above")
    below, high = meta.get("below"), meta.get("maximum")
    types: type | tuple[type, ...] = int if kind == "int" else (int, float)
    if kind != "int" and isinstance(value, str) and _EXPONENT.match(value.strip()):
        value = float(value)
    ok = not isinstance(value, bool) and isinstance(value, types)
    number = float(value) if ok else 0.0  # type: ignore[arg-type]
    ok = (
        ok
        and math.isfinite(number)
        and not (
            (low is not None and number < low)
            or (above is not None and number <= above)
            or (below is not None and number >= below)
            or (high is not None and number > high)
        )
    )
    if not ok:
        what = meta.get("what") or ("an integer" if kind == "int" else "a number")
        bounds = _bounds(low, above, below, high)
        raise ConfigError(f"{path}: expected {what}{bounds}, got {value!r}")
    return int(value) if kind == "int" else number  # type: ignore[call-overload]


def _bounds(low: float | None, above: float | None, below: float | None, high: float | None) -> str:
    if below is None and high is None:
        if low is None and above is None:
            return ""
        return f" >= {low}" if low is not None else f" > {above}"
    start = f"[{low}" if low is not None else f"({above}" if above is not None else "(-inf"
    return f" in {start}, {below})" if below is not None else f" in {start}, {high}]"


def _name(value: object, path: str) -> str:
    try:
        return check_name(str(value), path)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _shape(value: object, path: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list | tuple)
        or not value
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in value)
    ):
        raise ConfigError(f"{path}: expected a list of positive integers, got {value!r}")
    if len(value) > 8 or math.prod(value) > MAX_SAMPLE_ELEMENTS:
        raise ConfigError(
            f"{path}: {list(value)} is larger than a sample may be (at most 8 dimensions and "
            f"{MAX_SAMPLE_ELEMENTS:,} values)"
        )
    return tuple(value)


_UNITS: dict[str, Callable[[object, str], Any]] = {
    "duration": parse_duration,
    "memory": parse_memory,
    "flops": parse_flops,
    "bandwidth": parse_bandwidth,
    "name": _name,
    "shape": _shape,
}


def config_to_dict(config: object, exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``config`` as plain JSON-able data under its file keys (``parse_config`` reads it back)."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, spec.name)
        if spec.metadata.get("flat"):
            out.update(config_to_dict(value, exclude))
        elif _key(spec) not in exclude:
            out[_key(spec)] = _plain(value, spec.metadata.get("dump"))
    return out


def _plain(value: Any, dump: Callable[[Any], Any] | None) -> Any:
    if dump is not None:
        return dump(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, tuple | list):
        return [_plain(item, None) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item, None) for key, item in value.items()}
    return value


def _input_range(value: object, path: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [0, value]
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
        or not value[0] < value[1]
        or value[0] < -(2**62)
        or value[1] > 2**62
    ):
        raise ConfigError(
            f"{path}: expected the number of token ids N (ids in [0, N)) or [low, high) "
            f"with low < high, got {value!r}"
        )
    return int(value[0]), int(value[1])


def _names(value: object, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{path}: expected a list of module names, got {value!r}")
    return tuple(value)


def _listed(value: Any) -> Any:
    return None if value is None else list(value)


@dataclass(frozen=True)
class ModelConfig:
    """Which network: a zoo name (or ``package.module:function``), its input and classes."""

    name: str = setting(key="model", what="a zoo name or package.module:function")
    input_shape: tuple[int, ...] = setting(kind="shape")
    num_classes: int = setting(minimum=2, maximum=10_000_000)
    input_dtype: str = setting("float32", choices=INPUT_DTYPE_NAMES)
    # token ids lie in [low, high); a single number N means [0, N)
    input_range: tuple[int, int] | None = setting(None, parse=_input_range, dump=_listed)
    # module names the model may be cut before (else every legal cut, split_models.autosplit)
    split_points: tuple[str, ...] = setting((), parse=_names, dump=_listed)
    # classification, or language-model: the next token at every position (labels [length])
    task: str = setting("classification", choices=TASKS)

    def __post_init__(self) -> None:
        self.options  # noqa: B018 (validates the combination)

    @property
    def options(self) -> ModelOptions:
        return ModelOptions(self.input_dtype, self.input_range, self.split_points, self.task)

    def build(self, seed: int | None = None) -> SplittableModel:
        """The model this section names, built (``seed``: its initial weights)."""
        from split_models.zoo import build_model

        return build_model(self.name, self.input_shape, self.num_classes, seed, self.options)


@dataclass(frozen=True)
class TrainingConfig:
    """How each round trains: plain data, so a device can be sent it as it is."""

    rounds: int = setting(minimum=1, maximum=1_000_000)
    local_epochs: int = setting(1, minimum=1, maximum=10_000)
    batch_size: int = setting(32, minimum=1, maximum=1 << 16)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    local_loss: str = setting("linear", choices=LOCAL_LOSSES)
    mode: str = setting("local-loss", choices=MODES)
    compression: str = setting("fp32", choices=ENCODINGS)
    seed: int = setting(0, minimum=0, maximum=2**32 - 1)
    round_deadline_seconds: float = setting(
        300.0, key="round_deadline", aliases=("round_deadline_seconds",), kind="duration"
    )
    federated_eval: float = setting(  # the share of each edge's data held out (0: off)
        0.0, minimum=0, below=1, what="the share of each edge's data to hold out for evaluation"
    )
    # the GPU server trains the edges' batches one edge after another, in name order, so the
    # same seed gives the same weights bit for bit (with one server; rounds take longer)
    deterministic: bool = False
    # BatchNorm layers: "average" aggregates them; "local" keeps each device's own between
    # rounds (FedBN; the global model holds their average); "recalibrate" averages them, then
    # the edges that trained measure the aggregate's running statistics (coordinator.statistics)
    norm: str = setting("recalibrate", choices=NORMS)
    # an edge whose local head can be the model's back (the classifier after the cut) starts
    # each round's head from the back's weights (split_models.mirror); false: its own head
    head_from_back: bool = True
    # GPU servers bound each step of the back (optimizer.max_step: the gradient clipped at
    # norm server_max_step / lr): unbounded, SGD momentum 0.9 at lr 0.05 diverged; a clip at
    # 1.0 slowed lr 0.01 by 2 points in 5 rounds (docs/benchmarks.md, "Stable split training")
    server_max_step: float | None = setting(0.05, above=0, what="a positive number (or null: off)")
    # and clip the back's gradient norm to this (and optimizer.clip_norm; null: off)
    server_clip_norm: float | None = setting(None, above=0, what="a positive number (or null: off)")
    # GPU servers refuse activations of larger magnitude (finite, but overflowing the back)
    max_activation: float = setting(1e8, above=0, what="a positive number")
    # local-loss: GPU servers merge edge batches smaller than batch_size into steps of
    # batch_size; false: a step per edge batch (docs/benchmarks.md, "Clients at scale")
    server_fill: bool = True

    def server_optimizer(self) -> OptimizerConfig:
        """The optimizer of a GPU server's piece: ``optimizer`` with the servers' bounds."""
        clips = [c for c in (self.optimizer.clip_norm, self.server_clip_norm) if c is not None]
        steps = [c for c in (self.optimizer.max_step, self.server_max_step) if c is not None]
        return dataclasses.replace(
            self.optimizer,
            clip_norm=min(clips) if clips else None,
            max_step=min(steps) if steps else None,
        )

    def lr_scale(self, round_number: int) -> float:
        """The factor of the learning rate in ``round_number`` (``optimizer.lr_decay``)."""
        return self.optimizer.round_scale(round_number, self.rounds)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def parse(cls, data: object) -> TrainingConfig:
        return parse_config(cls, data, "training")
