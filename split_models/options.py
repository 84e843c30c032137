"""The names and settings that configs, the command line and plans check against, without
torch: reading a config or a store (``edgesplit status``) must not wait 1-2 s for torch to load.
The modules that build things (:mod:`split_models.segment`, :mod:`split_models.zoo`,
:mod:`split_models.heads`) use and re-export these."""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from split_models.errors import ConfigError

# devices where Adam takes torch's fused kernel (tested here; others take the per-tensor loop)
_FUSED_DEVICES = frozenset({"cpu", "cuda"})

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

__all__ = [
    "ADAMS",
    "INPUT_DTYPE_NAMES",
    "LOCAL_LOSSES",
    "LR_DECAYS",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "TASKS",
    "ZOO_NAMES",
    "ModelOptions",
    "OptimizerConfig",
    "add_model_path",
    "unused_optimizer_keys",
    "warn_unused_optimizer_keys",
]

LOCAL_LOSSES = ("linear", "mlp", "supcon")
ZOO_NAMES = ("mlp", "cnn", "resnet8", "resnet20", "resnet32")
INPUT_DTYPE_NAMES = ("float32", "int64")  # torch's dtypes: split_models.zoo.INPUT_DTYPES
_INTEGER_DTYPES = frozenset({"int64"})
# classification: a label per sample; language-model: token ids in, the next token at every
# position out (labels [length], logits [length, vocabulary])
TASKS = ("classification", "language-model")


@dataclass(frozen=True)
class ModelOptions:
    """What a model takes besides its shape: ``input_dtype`` (``int64`` for token ids, which
    lie in ``input_range`` = [low, high)), the module names it may be cut before, and its
    task (a label per sample, or a token per position for a language model)."""

    input_dtype: str = "float32"
    input_range: tuple[int, int] | None = None
    split_points: tuple[str, ...] = ()
    task: str = "classification"

    def __post_init__(self) -> None:
        if self.input_dtype not in INPUT_DTYPE_NAMES:
            raise ConfigError(
                f"input_dtype: unknown {self.input_dtype!r}; use one of {list(INPUT_DTYPE_NAMES)}"
            )
        integer = self.input_dtype in _INTEGER_DTYPES
        if integer and self.input_range is None:
            raise ConfigError(
                f"input_range: input_dtype {self.input_dtype} needs the range of its ids, "
                "e.g. input_range: 1000 (a vocabulary of 1000 tokens) or [0, 1000]"
            )
        if self.task not in TASKS:
            raise ConfigError(f"task: unknown {self.task!r}; use one of {list(TASKS)}")
        if self.task == "language-model" and not integer:
            raise ConfigError(
                "task: a language-model takes token ids: set input_dtype: int64 and input_range"
            )
        if self.input_range is not None:
            low, high = self.input_range
            if not integer or not low < high:
                raise ConfigError(
                    f"input_range: expected [low, high) with low < high for integer inputs, "
                    f"got {list(self.input_range)} with input_dtype {self.input_dtype}"
                )

    @property
    def dtype(self) -> torch.dtype:
        from split_models.zoo import INPUT_DTYPES

        return INPUT_DTYPES[self.input_dtype]

    def to_dict(self) -> dict[str, object]:
        return {
            "input_dtype": self.input_dtype,
            "input_range": None if self.input_range is None else list(self.input_range),
            "split_points": list(self.split_points),
            "task": self.task,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelOptions:
        bounds = data.get("input_range")
        return cls(
            input_dtype=str(data.get("input_dtype", "float32")),
            input_range=None if bounds is None else tuple(bounds),  # type: ignore[arg-type]
            split_points=tuple(data.get("split_points", ())),  # type: ignore[arg-type]
            task=str(data.get("task", "classification")),
        )


OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
ADAMS = ("adam", "adamw")  # two moments a weight; steps not lr * g
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # copies of the weights
LR_DECAYS = ("none", "cosine")  # across rounds
HEAD_RATE_CAP = 0.1  # the default rule speeds SGD heads up to this rate at most


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer trains a segment; ``build`` creates it for the given parameters.

    ``clip_norm``: each step's gradient is scaled down to this global L2 norm when above it
    (off by default); ``warmup_steps``: the learning rate ramps up linearly over the first
    steps of every round (each round starts a fresh optimizer state, so momentum and Adam's
    moments restart with it); ``lr_decay``: ``cosine`` scales round r of R by
    ``(1 + cos(pi (r - 1) / R)) / 2`` (1 in the first round, about ``2.5 / R**2`` in the
    last), which every edge, GPU server and baseline applies to the rounds it trains;
    ``max_step``: each step's gradient is clipped at the norm ``max_step / lr``, ``lr`` the
    step's own (warm-up and decay applied), so a plain SGD step moves the weights by at most
    ``max_step``: a bound on the step, where ``clip_norm`` bounds the gradient (a clip that
    holds lr 0.1 steady slowed lr 0.01 down; GPU servers bound theirs: ``server_max_step``);
    ``head_lr_scale``: a local-loss head (the auxiliary classifier under a segment) learns at
    this multiple of the segment's rate, so it keeps up with the features it reads; absent
    (None), :meth:`head_scale`'s rule: SGD heads at three times a low rate, at most 0.1, Adam's
    at the segment's (docs/benchmarks.md, "Local heads at a faster rate"). ``max_step``
    counts the head's faster steps; ``clip_norm`` bounds the gradient whatever the rates."""

    name: str = "sgd-momentum"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_norm: float | None = None
    warmup_steps: int = 0
    lr_decay: str = "none"
    max_step: float | None = None
    head_lr_scale: float | None = None
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.lr_decay not in LR_DECAYS:
            raise ConfigError(
                f"optimizer.lr_decay: unknown {self.lr_decay!r}; use one of {LR_DECAYS}"
            )
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optimizer.name: unknown {self.name!r}; use one of {OPTIMIZERS}")
        if not 0 < self.lr <= 100:
            raise ConfigError(f"optimizer.lr: must be positive (at most 100), got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.momentum: must be in [0, 1), got {self.momentum}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"optimizer.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.clip_norm is not None and not 0 < self.clip_norm < math.inf:
            raise ConfigError(
                f"optimizer.clip_norm: must be positive (or absent: no clipping), got "
                f"{self.clip_norm}"
            )
        if self.max_step is not None and not 0 < self.max_step < math.inf:
            raise ConfigError(
                f"optimizer.max_step: must be positive (or absent: no bound), got {self.max_step}"
            )
        if self.head_lr_scale is not None and not 0 < self.head_lr_scale <= 10_000:
            raise ConfigError(
                f"optimizer.head_lr_scale: must be in (0, 10000] (or absent: the rule), got "
                f"{self.head_lr_scale}"
            )
        if self.nesterov is not False and (
            self.nesterov is not True or self.name != "sgd-momentum" or not self.momentum
        ):
            raise ConfigError(
                f"optimizer.nesterov: true or false, and true only with sgd-momentum and a "
                f"momentum above 0 (got {self.nesterov!r} with {self.name}, momentum "
                f"{self.momentum})"
            )
        if not 0 <= self.warmup_steps <= 10**9:
            raise ConfigError(
                f"optimizer.warmup_steps: must be in [0, 1e9], got {self.warmup_steps}"
            )

    def head_scale(self) -> float:
        """The multiple of the segment's rate its local head learns at: ``head_lr_scale``,
        or by default, for SGD, three times ``lr`` up to a rate of 0.1 and never below ``lr``
        (3 at lr 0.01-0.033, 2 at 0.05, 1 from 0.1: faster heads lifted local-loss at lr
        0.01, where it trailed, and diverged at lr 0.1); for Adam 1 (a faster Adam head
        changed nothing)."""
        if self.head_lr_scale is not None:
            return self.head_lr_scale
        if self.name in ADAMS:
            return 1.0
        return max(1.0, min(3.0, HEAD_RATE_CAP / self.lr))

    def round_scale(self, round_number: int, rounds: int) -> float:
        """The factor of the learning rate in round ``round_number`` (from 1) of ``rounds``:
        1 without decay, and for a round outside 1..rounds (a resumed run given more rounds)."""
        if self.lr_decay == "none" or not 1 <= round_number <= rounds:
            return 1.0
        return (1 + math.cos(math.pi * (round_number - 1) / rounds)) / 2

    def lr_at(self, step: int) -> float:
        """The learning rate of a round's ``step``-th optimizer step (from 0)."""
        if step >= self.warmup_steps:
            return self.lr
        return self.lr * (step + 1) / (self.warmup_steps + 1)

    def build(
        self, parameters: list[nn.Parameter], head: Sequence[nn.Parameter] = ()
    ) -> torch.optim.Optimizer:
        """The optimizer of ``parameters``; those also in ``head`` (a local-loss head's) form
        a second group whose ``lr_scale`` is :meth:`head_scale` (the steps set each group's
        rate to the step's rate times its ``lr_scale``)."""
        import torch

        heads = {id(p) for p in head}
        groups = [
            {"params": [p for p in parameters if id(p) not in heads], "lr_scale": 1.0},
            {"params": [p for p in parameters if id(p) in heads], "lr_scale": self.head_scale()},
        ]
        groups = [g for g in groups if g["params"]]
        if self.name in ADAMS:
            # the fused kernel updates every tensor in one call where the default is a Python
            # loop over them: the optimizer's step 2-3x faster on the CPU, a whole segment
            # step up to 1.2x (docs/benchmarks.md), same values to float rounding. Elsewhere
            # (complex weights, devices not checked here) the loop
            fused = all(
                p.device.type in _FUSED_DEVICES and p.is_floating_point() for p in parameters
            )
            adam = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
            return adam(groups, lr=self.lr, weight_decay=self.weight_decay, fused=fused or None)
        momentum = self.momentum if self.name == "sgd-momentum" else 0.0
        return torch.optim.SGD(
            groups,
            lr=self.lr,
            momentum=momentum,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
        )


def unused_optimizer_keys(written: object, used: OptimizerConfig) -> list[str]:
    """What a config file's ``optimizer`` section (``written``) sets that the optimizer it
    ends up with (``used``, after the command line's flags) ignores, one line each: momentum
    with anything but ``sgd-momentum``. Said, not refused: a stored run's config carries the
    default momentum whatever its optimizer."""
    if not isinstance(written, Mapping) or "momentum" not in written:
        return []
    if used.name == "sgd-momentum":
        return []
    return [
        f"optimizer.momentum {written['momentum']!r} has no effect with optimizer "
        f"{used.name!r}: only 'sgd-momentum' uses it"
    ]


def warn_unused_optimizer_keys(source: object, data: object, used: OptimizerConfig) -> None:
    """A warning for each :func:`unused_optimizer_keys` line of config file ``source`` (its
    parsed mapping ``data``), whose optimizer ended up as ``used``."""
    written = data.get("optimizer") if isinstance(data, Mapping) else None
    for line in unused_optimizer_keys(written, used):
        log.warning("%s: %s", source, line)


def add_model_path(folder: str | os.PathLike[str]) -> None:
    """Let ``package.module:function`` models be found in ``folder`` (a config file's)."""
    path = os.path.abspath(folder)
    if path not in sys.path:
        sys.path.insert(0, path)
