"""The model and training sections as they arrive: from a task on the network (checked
against what the device may build) or written by hand (a nested ``model:`` section)."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from split_models.config import ModelConfig, TrainingConfig, config_keys, parse_config
from split_models.errors import ConfigError
from split_models.options import ZOO_NAMES

__all__ = [
    "batch_norm_blocks",
    "block_count",
    "check_norm_batch",
    "flat_model_section",
    "parse_task_sections",
    "task_sections",
]


def flat_model_section(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with a nested ``model: {name: ..., input_shape: ...}`` section (as people
    write it) spread into the flat keys of RUN.yaml and SIM.yaml; a key given in both
    places is refused by name."""
    fields = dict(data)
    section = fields.get("model")
    if not isinstance(section, Mapping):
        return fields
    section = dict(section)
    if "name" not in section:
        raise ConfigError("model: a model section needs its name (model: {name: resnet8, ...})")
    fields["model"] = section.pop("name")
    valid = config_keys(ModelConfig)
    for key, value in section.items():
        if key not in valid:
            raise ConfigError(f"model.{key}: unknown key; valid: {sorted(valid - {'model'})}")
        if key in fields:
            raise ConfigError(f"model.{key}: given twice (in the model section and at the top)")
        fields[key] = value
    return fields


def task_sections(
    model: object, training: object, models: Collection[str] = ()
) -> tuple[ModelConfig, TrainingConfig]:
    """:func:`parse_task_sections`, remembered for the last sections seen: a simulation host's
    clients parse the same task's sections every round (the configs are frozen, so sharing
    them is safe)."""
    try:
        key = json.dumps([model, training], sort_keys=True)
    except (TypeError, ValueError):  # not what a JSON message holds: parsed, and refused
        return parse_task_sections(model, training, models)
    return _remembered(key, tuple(models))


def block_count(model: ModelConfig) -> int:
    """How many blocks ``model`` has (built once per model a process: a task's blocks are
    checked against it before anything is built for them)."""
    return _shape_of(model)[0]


def batch_norm_blocks(model: ModelConfig) -> frozenset[int]:
    """The blocks of ``model`` holding a BatchNorm layer, which cannot train on a batch of
    one example (built once per model a process, as :func:`block_count`)."""
    return _shape_of(model)[1]


@functools.lru_cache(maxsize=8)
def _shape_of(model: ModelConfig) -> tuple[int, frozenset[int]]:
    blocks = model.build(seed=0).blocks
    return len(blocks), _norm_blocks(blocks)


def _norm_blocks(blocks: Iterable[Any]) -> frozenset[int]:
    from torch import nn

    norms = (nn.modules.batchnorm._BatchNorm,)
    return frozenset(
        index
        for index, block in enumerate(blocks)
        if any(isinstance(m, norms) for m in block.modules())
    )


def check_norm_batch(blocks: Iterable[Any], batch_size: int | None) -> None:
    """A batch of one cannot train a model's BatchNorm ``blocks`` (BatchNorm's own
    ValueError read as an unexpected error in plan and simulate)."""
    if batch_size is not None and batch_size < 2 and (norms := _norm_blocks(blocks)):
        raise ConfigError(
            f"batch_size: {batch_size}, but the model's BatchNorm layers (in blocks "
            f"{sorted(norms)}) cannot train on a batch of one example; use a batch of 2 or more"
        )


@functools.lru_cache(maxsize=64)
def _remembered(key: str, models: tuple[str, ...]) -> tuple[ModelConfig, TrainingConfig]:
    model, training = json.loads(key)
    return parse_task_sections(model, training, models)


def parse_task_sections(
    model: object, training: object, models: Collection[str] = ()
) -> tuple[ModelConfig, TrainingConfig]:
    """A task's ``model`` and ``training`` sections, parsed; raises :class:`ConfigError`
    naming the bad field as ``task.model.<key>`` or ``task.training.<key>``. The model must
    be a zoo model or one of ``models``, the import paths the device was started with: a
    message never makes a device import code."""
    spec = parse_config(ModelConfig, model, "task.model", prefix="task.model.")
    if spec.name not in ZOO_NAMES and spec.name not in models:
        allowed = ", ".join([*ZOO_NAMES, *models])
        raise ConfigError(
            f"task.model.model: {spec.name!r} is not a model this device may build; it builds "
            f"{allowed} (start it with --model {spec.name} to allow that import path)"
        )
    return spec, parse_config(TrainingConfig, training, "task.training", prefix="task.training.")
