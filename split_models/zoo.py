"""Splittable models: an ordered list of blocks, where a split point is a block index.

The zoo has ``mlp``, ``cnn`` (any small grayscale or colour image, e.g. 28x28 or 8x8) and the
CIFAR-style ``resnetN`` family (N = 6n+2: resnet8, resnet20, resnet32...). A user model is given as
``package.module:function``; the function may accept ``input_shape`` and ``num_classes`` keyword
arguments and returns any ``nn.Module`` (split automatically, :mod:`split_models.autosplit`), an
``nn.Sequential`` or a list of modules (whose items are the blocks, as they are).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import math
import os
import re
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from split_models.activations import Activation, primary
from split_models.autosplit import auto_blocks, disable_inplace
from split_models.errors import ConfigError, ModelError
from split_models.options import TASKS as TASKS
from split_models.options import ZOO_NAMES as ZOO_NAMES
from split_models.options import ModelOptions as ModelOptions
from split_models.options import add_model_path as add_model_path
from split_models.randomness import apart

__all__ = [
    "INPUT_DTYPES",
    "TASKS",
    "ZOO_NAMES",
    "ModelOptions",
    "SplittableModel",
    "add_model_path",
    "build_model",
    "check_model_name",
    "example_input",
]

INPUT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int64": torch.int64}


_RESNET = re.compile(r"^resnet(\d+)$")


@dataclass
class SplittableModel:
    """A model as an ordered list of blocks; ``segment(i, j)`` runs blocks ``[i, j)``."""

    name: str
    blocks: nn.ModuleList
    input_shape: tuple[int, ...]
    num_classes: int
    options: ModelOptions = ModelOptions()  # noqa: RUF009 (frozen: one shared default is safe)
    # a traced model's parameters and buffers that forward never reads (in no block), as
    # built: trained by nobody, they complete its state dict (coordinator/export.py)
    unused: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    # a traced model's state dict keys as built: its blocks hold buffers it does not save
    # (``persistent=False``, BERT's position ids) as their own, saved ones
    saved: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def per_position(self) -> bool:
        """A language model: labels and predictions at every position of the input."""
        return self.options.task == "language-model"

    @property
    def label_shape(self) -> tuple[int, ...]:
        """One sample's labels: ``()`` for a class, ``(length,)`` for a token per position."""
        return self.input_shape[:1] if self.per_position else ()

    def example_input(
        self, batch: int, generator: torch.Generator | None = None, zeros: bool = False
    ) -> torch.Tensor:
        """A batch of valid model inputs: standard normal floats, or ids drawn uniformly from
        ``input_range`` (``zeros``: the smallest valid value everywhere)."""
        return example_input(self.input_shape, self.options.input_range, batch, generator, zeros)

    def segment(self, start: int, end: int) -> nn.Sequential:
        """The blocks ``[start, end)`` as one module sharing parameters with this model."""
        if not 0 <= start < end <= self.num_blocks:
            raise ModelError(
                f"segment [{start}, {end}) is outside the model's {self.num_blocks} blocks; "
                f"use 0 <= start < end <= {self.num_blocks}"
            )
        return nn.Sequential(*self.blocks[start:end])

    def full(self) -> nn.Sequential:
        return self.segment(0, self.num_blocks)

    def cut_values(self, zeros: bool = False) -> list[Activation]:
        """What each block passes on for one example (``zeros``: the all-smallest input):
        entry ``i`` is block ``i``'s output, a tensor or ``(activation, *side)``. Computed in
        eval mode without gradients; the blocks' modes are put back."""
        values = []
        with torch.no_grad():
            value: Activation = self.example_input(1, zeros=zeros)
            for block in self.blocks:
                was_training = block.training
                block.eval()
                try:
                    value = block(value)
                finally:
                    block.train(was_training)
                values.append(value)
        return values


def example_input(
    shape: Sequence[int],
    ids: tuple[int, int] | None,
    batch: int,
    generator: torch.Generator | None = None,
    zeros: bool = False,
) -> torch.Tensor:
    """A batch of valid inputs of ``shape``: standard normal floats, or int64 token ids
    drawn from ``ids`` = [low, high) (``zeros``: the smallest valid value everywhere)."""
    size = (batch, *shape)
    if ids is None:
        return torch.zeros(size) if zeros else torch.randn(size, generator=generator)
    if zeros:
        return torch.full(size, ids[0], dtype=torch.int64)
    return torch.randint(ids[0], ids[1], size, generator=generator, dtype=torch.int64)


def _mlp(input_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    features = math.prod(input_shape)
    return [
        nn.Sequential(nn.Flatten(), nn.Linear(features, 1024), nn.ReLU()),
        nn.Sequential(nn.Linear(1024, 512), nn.ReLU()),
        nn.Sequential(nn.Linear(512, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, num_classes)),
    ]


def _image_shape(name: str, input_shape: tuple[int, ...], min_side: int) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise ConfigError(
            f"input_shape: model {name!r} needs an image shape [channels, height, width] with "
            f"height and width >= {min_side}, got {list(input_shape)}"
        )
    channels, height, width = input_shape
    return channels, height, width


def _cnn(input_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    channels, height, width = _image_shape("cnn", input_shape, 4)
    flat = 64 * (height // 4) * (width // 4)
    return [
        nn.Sequential(nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(flat, 128), nn.ReLU()),
        nn.Sequential(nn.Linear(128, num_classes)),
    ]


class _BasicBlock(nn.Module):
    """The two-convolution residual block of He et al. (2016), CIFAR variant."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))  # type: ignore[no-any-return]


def _resnet(depth: int, input_shape: tuple[int, ...], num_classes: int) -> list[nn.Module]:
    if depth < 8 or (depth - 2) % 6:
        raise ConfigError(f"model: resnet depth must be 6n+2 (8, 14, 20, 32...), got {depth}")
    channels, _, _ = _image_shape(f"resnet{depth}", input_shape, 4)
    per_stage = (depth - 2) // 6
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
    ]
    width_in = 16
    for stage, width in enumerate((16, 32, 64)):
        for index in range(per_stage):
            stride = 2 if stage > 0 and index == 0 else 1
            blocks.append(_BasicBlock(width_in, width, stride))
            width_in = width
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)))
    return blocks


def _import_factory(path: str) -> Callable[..., object]:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"model: {path!r} is neither a zoo model ({', '.join(ZOO_NAMES)}, or any "
            "resnetN with N = 6n+2) "
            "nor an import path of the form 'package.module:function'"
        )
    try:
        module = _import(module_name)
    except ImportError as error:
        raise ModelError(
            f"model: cannot import module {module_name!r}: {error}. edgesplit looks in the "
            "working directory, the config file's folder (a command given one) and PYTHONPATH: "
            "run it from the module's folder or add that folder to PYTHONPATH"
        ) from error
    except Exception as error:  # a syntax error or a failure while the user's module runs
        raise ModelError(
            f"model: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelError(f"model: {module_name!r} has no callable named {attribute!r}")
    return factory  # type: ignore[no-any-return]


def _import(module_name: str) -> object:
    """Import ``module_name``; when it (or a module it imports, such as a sibling of the
    user's file) is not found, once more with the working directory on the import path (as
    ``python -m`` would have it)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        if os.getcwd() in sys.path:
            raise
        add_model_path(os.getcwd())
        return importlib.import_module(module_name)


def _call_factory(
    factory: Callable[..., object], input_shape: tuple[int, ...], num_classes: int
) -> object:
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    needed = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in variadic
        and name not in ("input_shape", "num_classes")
    ]
    if needed:
        raise ModelError(
            f"model: {factory.__qualname__}() needs {', '.join(needed)}, which edgesplit does "
            "not pass: a factory may take input_shape and num_classes; give the rest defaults"
        )
    kwargs: dict[str, object] = {}
    if takes_any or "input_shape" in parameters:
        kwargs["input_shape"] = input_shape
    if takes_any or "num_classes" in parameters:
        kwargs["num_classes"] = num_classes
    try:
        return factory(**kwargs)
    except Exception as error:  # the user's code: named as theirs, not as edgesplit's fault
        raise ModelError(
            f"model: {factory.__module__}:{factory.__qualname__}() raised "
            f"{type(error).__name__}: {error}"
        ) from error


def _as_blocks(
    path: str, built: object, example: torch.Tensor, options: ModelOptions, key: Hashable
) -> list[nn.Module]:
    if isinstance(built, nn.Sequential | nn.ModuleList) and not options.split_points:
        blocks: list[object] = list(built)
    elif isinstance(built, nn.Module):
        return auto_blocks(built, example, options.split_points, key)
    elif isinstance(built, Sequence) and not isinstance(built, str):
        if options.split_points:
            raise ModelError(
                f"split_points: {path!r} returned a list of blocks, whose joints are its "
                "cuts; split_points marks cuts in a model traced whole (return an nn.Module)"
            )
        blocks = list(built)
    else:
        raise ModelError(
            f"model: {path!r} returned {type(built).__name__}; return an nn.Module, an "
            "nn.Sequential or a list of nn.Module blocks"
        )
    for index, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise ModelError(f"model: block {index} of {path!r} is {type(block).__name__}")
    if not blocks:
        raise ModelError(f"model: {path!r} returned no blocks")
    return [disable_inplace(block) for block in blocks if isinstance(block, nn.Module)]


def _he_init(blocks: list[nn.Module]) -> list[nn.Module]:
    """He (Kaiming) initialisation for the plain ReLU zoo models. PyTorch's default scales
    weights for a leaky slope of sqrt(5), so the signal shrinks block by block and training
    sits on a loss plateau for its first epochs; with local losses and federated averaging
    that plateau lasts rounds."""
    for block in blocks:
        for module in block.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return blocks


def _zoo_blocks(name: str, shape: tuple[int, ...], num_classes: int) -> list[nn.Module] | None:
    """The blocks of the zoo's model ``name`` (None: not a zoo name)."""
    resnet = _RESNET.match(name)
    if name == "mlp":
        return _he_init(_mlp(shape, num_classes))
    if name == "cnn":
        return _he_init(_cnn(shape, num_classes))
    if resnet is not None:
        return _resnet(int(resnet.group(1)), shape, num_classes)
    return None


def check_model_name(name: str) -> None:
    """Raise now (:class:`ConfigError`, :class:`ModelError`) for a ``name`` that is neither
    the zoo's nor an import path whose module imports and holds that factory: an agent
    started with a typo went online and failed only when a run offered it the model."""
    if name in ZOO_NAMES or _RESNET.match(name):
        return
    try:
        _import_factory(name)
    except (ConfigError, ModelError) as error:
        raise type(error)(f"--model {name}: {error}") from error


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int | None = None,
    options: ModelOptions | None = None,
) -> SplittableModel:
    """Build a zoo model by name or a user model from ``package.module:function``: seeded,
    apart from training threads' random numbers and leaving torch's generator as it was
    (:func:`~split_models.randomness.apart`)."""
    with apart():
        return _build(name, input_shape, num_classes, seed, options)


def _build(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int | None,
    options: ModelOptions | None,
) -> SplittableModel:
    options = options or ModelOptions()
    shape = tuple(int(d) for d in input_shape)
    if not shape or min(shape) < 1:
        raise ConfigError(f"input_shape: expected positive sizes, got {list(input_shape)}")
    if num_classes < 2:
        raise ConfigError(f"num_classes: expected at least 2, got {num_classes}")
    if seed is not None:
        torch.manual_seed(seed)
    zoo = _zoo_blocks(name, shape, num_classes)
    if zoo is not None:
        if options.split_points:
            raise ConfigError(
                f"split_points: the zoo's {name} comes in fixed blocks, cut only between them; "
                "split_points marks cuts in your own model (package.module:function)"
            )
        blocks = zoo
    else:
        factory = _import_factory(name)
        built = _call_factory(factory, shape, num_classes)
        example = example_input(shape, options.input_range, 2, zeros=True)
        key = (name, factory, shape, num_classes, options)  # a module imported again: traced again
        blocks = _as_blocks(name, built, example, options, key)
    unused, saved = _built_state(built, blocks) if zoo is None else ({}, frozenset())
    model = SplittableModel(name, nn.ModuleList(blocks), shape, num_classes, options, unused, saved)
    if zoo is None and key not in _OUTPUTS_CHECKED:
        _check_outputs(model)
        _OUTPUTS_CHECKED.add(key)
    return model


def _built_state(
    built: object, blocks: Sequence[nn.Module]
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """What of a traced model's state dict no block holds (a layer defined but not used),
    and the keys of that state dict (none for a model given in blocks)."""
    if not isinstance(built, nn.Module) or not all(isinstance(b, fx.GraphModule) for b in blocks):
        return {}, frozenset()
    used = {name for block in blocks for name in block.state_dict()}
    state = built.state_dict()
    return {k: v.detach().clone() for k, v in state.items() if k not in used}, frozenset(state)


_OUTPUTS_CHECKED: set[Hashable] = set()  # user models whose output fits num_classes


def _check_outputs(model: SplittableModel) -> None:
    """A user model whose output is not ``num_classes`` wide (a score per class, for every
    position of a language model) fails mid-round on its first loss: named here instead."""
    try:  # fx prints the traceback of a failing traced forward: the one line below says it
        with contextlib.redirect_stderr(io.StringIO()):
            tensor = primary(model.cut_values(zeros=True)[-1])
    except Exception as error:  # a user's forward on one example: anything
        raise ModelError(
            f"model: running {model.name!r} on one example of shape "
            f"{[1, *model.input_shape]} failed: {type(error).__name__}: {error}; forward takes "
            "one tensor of input_shape with the batch first (a model of a tuple or dict of "
            "inputs needs a wrapper module that builds it from one)"
        ) from error
    want = [1, *model.label_shape, model.num_classes]
    if list(tensor.shape) != want:
        raise ModelError(
            f"model: {model.name!r} outputs shape {[*tensor.shape]} for one sample, the loss "
            f"needs {want}: one score per class (num_classes {model.num_classes})"
            + (" at every position" if model.per_position else "")
        )
