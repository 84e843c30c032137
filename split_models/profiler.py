"""Per-block profile of a model: parameters, activation sizes, bytes saved for backward, FLOPs.

Saved-for-backward bytes are measured, not guessed: the block runs forward on two probe batches
under ``torch.autograd.graph.saved_tensors_hooks`` and every saved tensor is counted once per
underlying storage (a ReLU output reused by the next layer counts once, MaxPool's int64 indices
count at their real size, parameters are excluded because they are counted as weights). Two
batch sizes separate the per-sample part from the part that does not grow with the batch.

The working set of backward (gradient buffers, kernel workspaces) depends on the kernels, so it
is measured too: on Linux the block runs forward and backward alone at two batch sizes while the
process's resident high-water mark is tracked, and the per-sample slope is kept. The first pass at
a new batch size also leaves kernels and caches resident (oneDNN generates code per shape); that
is measured as the growth of the exact resident size over that pass, in order (after the blocks
before it) and cold (each block in a fresh process of its own, ``split_models.cold_setup``).
Where none of this can be measured, three times the largest activation stands in for the
working set.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from split_models.activations import Activation, nbytes, primary, side
from split_models.cold_setup import cold_setups
from split_models.flops import count_flops
from split_models.heads import LOCAL_LOSSES, make_head
from split_models.measure import (
    PeakMeter,
    peak_supported,
    release_freed_memory,
    resident_bytes,
    trim_heap,
)
from split_models.sections import check_norm_batch
from split_models.zoo import SplittableModel, example_input

if TYPE_CHECKING:
    from split_models.config import ModelConfig

__all__ = [
    "BlockProfile",
    "ModelProfile",
    "first_pass_setups",
    "profile_model",
    "profile_module",
]

_PROBE_BATCHES = (2, 4)
_WORKING_SET_BATCH = 8
_WARM_UP_BATCH = 3
_MAX_PROBE_BATCH = 256
_MIN_PROBE_TENSOR = 256 * 1024
_FALLBACK_WORKING_SET = 3  # largest activations, when the working set cannot be measured


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs. Byte figures marked per-sample scale with the batch size."""

    param_bytes: int
    buffer_bytes: int
    largest_param_bytes: int
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    input_bytes: int  # per sample
    output_bytes: int  # per sample
    saved_bytes: int  # per sample, without the block's input and without parameters
    saved_fixed_bytes: int  # saved bytes that do not grow with the batch
    saves_input: bool
    saves_output: bool
    largest_activation_bytes: int  # per sample: biggest tensor any leaf layer produces
    flops: int  # forward FLOPs per sample
    backward_bytes: int = 0  # per sample: peak of a training pass beyond the saved bytes
    backward_fixed_bytes: int = 0  # the part of that peak that does not grow with the batch
    first_backward_bytes: int = 0  # the same two when the input needs no gradient (segment start)
    first_backward_fixed_bytes: int = 0
    kernel_setup_bytes: int = 0  # left resident by the first pass at the profiled batch size
    first_kernel_setup_bytes: int = 0  # the same when the input needs no gradient
    # The same two measured in a fresh process with no other block run before (0: not measured)
    cold_kernel_setup_bytes: int = 0
    first_cold_kernel_setup_bytes: int = 0
    summary: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockProfile:
        data = dict(data)
        data["input_shape"] = tuple(data["input_shape"])
        data["output_shape"] = tuple(data["output_shape"])
        return cls(**data)


@dataclass(frozen=True)
class ModelProfile:
    """Profiles of all blocks of a model and of the local-loss heads at every cut.

    ``heads[kind][s]`` profiles the ``kind`` head that sits on the output of block ``s - 1``;
    index 0 is unused and equals index 1 so the tuple can be indexed by the cut directly.
    """

    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    blocks: tuple[BlockProfile, ...]
    heads: dict[str, tuple[BlockProfile, ...]] = field(default_factory=dict)
    label_bytes: int = 8  # per sample: one int64 class, or one per position (language model)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        return cls(
            model=data["model"],
            input_shape=tuple(data["input_shape"]),
            num_classes=int(data["num_classes"]),
            blocks=tuple(BlockProfile.from_dict(b) for b in data["blocks"]),
            heads={
                kind: tuple(BlockProfile.from_dict(b) for b in profiles)
                for kind, profiles in data.get("heads", {}).items()
            },
            label_bytes=int(data.get("label_bytes", 8)),
        )


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


@dataclass
class _Probe:
    saved: dict[int, int]  # storage pointer -> bytes, without parameters
    input_key: int
    output_key: int
    largest_activation: int


Side = tuple[torch.Tensor, ...]  # weight-free tensors crossing a cut, one example each


def _inputs(
    shape: tuple[int, ...],
    batch: int,
    ids: tuple[int, int] | None,
    grad: bool = False,
    side: Side = (),
) -> Activation:
    """A probe batch: standard normal floats (needing a gradient with ``grad``), or token
    ids drawn from ``ids`` = [low, high) for a model's first block; with ``side``, the tuple
    of that and the side tensors' examples repeated to the batch."""
    inputs = example_input(shape, ids, batch)
    if ids is None:
        inputs.requires_grad_(grad)
    if not side:
        return inputs
    return (inputs, *(t.expand(batch, *t.shape[1:]).clone() for t in side))


def _run_probe(
    module: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    ids: tuple[int, int] | None,
    side: Side = (),
) -> _Probe:
    owned = {_storage_key(t)[0] for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}
    largest = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer, nbytes = _storage_key(tensor)
        if pointer not in owned:
            saved[pointer] = nbytes
        return tensor

    def record(_module: nn.Module, _inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            largest[0] = max(largest[0], output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in module.modules() if not list(m.children())]
    x = _inputs(input_shape, batch, ids, grad=True, side=side)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(x)
    finally:
        for hook in hooks:
            hook.remove()
    return _Probe(saved, _storage_key(primary(x))[0], _storage_key(primary(y))[0], largest[0])


def _saved_split(small: _Probe, large: _Probe) -> tuple[int, int]:
    """Per-sample and fixed saved bytes (block input excluded) from two probe batches."""

    def without_input(probe: _Probe) -> int:
        return sum(n for key, n in probe.saved.items() if key != probe.input_key)

    delta = _PROBE_BATCHES[1] - _PROBE_BATCHES[0]
    per_sample = max(0, (without_input(large) - without_input(small)) // delta)
    return per_sample, max(0, without_input(small) - per_sample * _PROBE_BATCHES[0])


class _Pass:
    """Training passes through fresh copies of one block, for one input-gradient setting."""

    def __init__(
        self,
        module: nn.Module,
        shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        input_grad: bool,
        ids: tuple[int, int] | None = None,
        side: Side = (),
    ) -> None:
        self.module, self.shape, self.out_shape = module, shape, out_shape
        self.input_grad, self.ids, self.side = input_grad, ids, side

    def peak(self, batch: int) -> int:
        """Peak resident bytes of forward, then backward from a gradient that autograd
        allocates and frees as a real incoming gradient would be (``(out * w).sum()``): the
        block's saved tensors, gradient buffers, kernel workspaces and its own weight gradients
        at their real lifetimes. The weights get fresh storage, so per-weight caches count.
        """
        with _fresh_state(self.module):
            inputs = _inputs(self.shape, batch, self.ids, self.input_grad, self.side)
            weight = torch.randn(batch, *self.out_shape)
            with PeakMeter() as meter:
                (primary(self.module(inputs)) * weight).sum().backward()  # type: ignore[no-untyped-call]
                return meter.peak()

    def repeat(self, batch: int) -> int:
        """The steady-state pass at ``batch`` (after a first one): the largest of three. The
        meter reads a peak short by the part of its last 32-page batch the kernel had not folded
        yet (0-124 KiB, differing from pass to pass); the heap is trimmed before each pass, so
        no pass reads high by reusing or growing it."""
        return max(self.peak(batch) for _ in range(3))

    def setup(self, batch: int) -> int:
        """Bytes the first pass at ``batch`` leaves resident: kernels generated and cached for
        that shape. Read from the exact resident size before and after; a difference of peaks
        would carry the meter's error twice and miss what is cached after the pass's peak."""
        trim_heap()
        before = resident_bytes()
        self.peak(batch)
        trim_heap()
        return max(0, resident_bytes() - before)


@contextlib.contextmanager
def _fresh_state(module: nn.Module) -> Iterator[None]:
    """Run ``module`` on fresh copies of its parameters and buffers (no gradients), put back
    afterwards: a pass neither changes the block (BatchNorm statistics, gradients) nor keeps
    anything alive after it. A copy of the whole block would instead: a traced block
    (``fx.GraphModule``, a class of its own per instance) and its graph refer to each other,
    so copies outlive their last reference until the cycle collector runs, and read as memory
    a pass left resident; collecting after every pass cost 0.1 s each (90 s for one
    MobileNetV3 profile)."""
    tensors = [*module.parameters(), *(b for b in module.buffers() if b is not None)]
    kept = [(t, t.data, t.grad) for t in tensors]
    try:
        for tensor in tensors:
            tensor.data = tensor.data.clone()
            tensor.grad = None
        yield
    finally:
        for tensor, data, grad in kept:
            tensor.data = data
            tensor.grad = grad


def _probe_batches(
    shape: tuple[int, ...], out_shape: tuple[int, ...], batch: int | None
) -> tuple[int, int]:
    """Two batches for the working-set slope: the planned batch (when known) and a quarter of
    it, and large enough that the block's tensors clear the mmap threshold."""
    widest = 4 * max(1, math.prod(shape), math.prod(out_shape))
    smallest = min(_MAX_PROBE_BATCH, max(_WORKING_SET_BATCH, -(-_MIN_PROBE_TENSOR // widest)))
    large = max(batch or 0, 4 * smallest)
    return large // 4, large


def _training_pass(
    module: nn.Module,
    shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    saved_bytes: int,
    largest: int,
    input_grad: bool,
    batch: int | None,
    ids: tuple[int, int] | None = None,
    side: Side = (),
) -> tuple[int, int, int]:
    """Per-sample and fixed bytes a steady-state training pass holds at its peak beyond the
    saved activations (the fixed part includes the block's weight gradients where they are
    live then), and the bytes its first pass at ``batch`` leaves resident (kernels generated
    and cached for that shape)."""
    if not any(p.requires_grad for p in module.parameters()) and not input_grad:
        return 0, 0, 0
    if not (peak_supported() and release_freed_memory()):
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        return _FALLBACK_WORKING_SET * largest, params, 0
    passes = _Pass(module, shape, out_shape, input_grad, ids, side)
    passes.peak(_WARM_UP_BATCH)  # lazily loaded code is runtime, measured separately
    small, large = _probe_batches(shape, out_shape, batch)
    target = batch or large
    # One-time runtime initialisation happened in the warm-up pass; what the first pass at the
    # planned batch leaves is made for that shape, as the first real step at it makes it.
    setup = passes.setup(target)
    at = {target: passes.repeat(target)}
    for size in (small, large):
        if size not in at:
            passes.peak(size)  # its kernels are made here, not in the steady state
            at[size] = passes.repeat(size)
    slope = (at[large] - at[small]) // (large - small)
    # Anchor the line at the planned batch, where the pass was measured directly: buffers of
    # BLAS kernels do not grow linearly, so extrapolating from the probe sizes would drift.
    return max(0, slope - saved_bytes), max(0, at[target] - slope * target), setup


def first_pass_setups(
    model: SplittableModel, index: int, batch_size: int | None
) -> tuple[int, int]:
    """The kernel setup of block ``index`` of ``model`` as :func:`_training_pass` measures it,
    without and with an input gradient (the second includes the first); in a fresh process that
    only built the model, it is the block's cold setup. ``(0, 0)`` where resident sizes cannot
    be measured."""
    if not (peak_supported() and release_freed_memory()):
        return 0, 0
    values = model.cut_values()
    block, side_in = model.blocks[index], _side_tensors(model)[index]
    shape = model.input_shape if index == 0 else tuple(primary(values[index - 1]).shape[1:])
    out_shape = tuple(primary(values[index]).shape[1:])
    ids = model.options.input_range if index == 0 else None
    target = batch_size or _probe_batches(shape, out_shape, batch_size)[1]
    setups = []
    block.train()
    for input_grad in (False, True) if ids is None else (False,):
        if not input_grad and not any(p.requires_grad for p in block.parameters()):
            setups.append(0)
            continue
        passes = _Pass(block, shape, out_shape, input_grad, ids, side_in)
        passes.peak(_WARM_UP_BATCH)
        setups.append(passes.setup(target))
    return setups[0], sum(setups)


def _summary(module: nn.Module) -> str:
    leaves = [type(m).__name__ for m in module.modules() if not list(m.children())]
    return "+".join(leaves) if len(leaves) <= 4 else f"{type(module).__name__}({len(leaves)})"


def _measure(
    module: nn.Module,
    shape: tuple[int, ...],
    batch_size: int | None,
    ids: tuple[int, int] | None,
    side: Side = (),
) -> dict[str, Any]:
    """The measured parts of a block's profile, taken in training mode."""
    was_training = module.training
    module.train()
    try:
        small, large = (_run_probe(module, shape, b, ids, side) for b in _PROBE_BATCHES)
        with torch.no_grad():
            out = module(_inputs(shape, _PROBE_BATCHES[0], ids, side=side))
        out_shape = tuple(primary(out).shape[1:])
        batch = _PROBE_BATCHES[0]
        flops = count_flops(module, _inputs(shape, batch, ids, side=side), batch)
        per_sample, fixed = _saved_split(small, large)
        largest_activation = large.largest_activation // _PROBE_BATCHES[1]
        # Without an input gradient first: its kernels are what a segment's first block makes;
        # the pass with one then adds only the kernels for the input gradient.
        common = (module, shape, out_shape, per_sample, largest_activation)
        first = _training_pass(*common, False, batch_size, ids, side)
        backward = first  # token ids take no gradient: the one pass is both
        if ids is None:
            backward = _training_pass(*common, True, batch_size, None, side)
        return {
            "output_shape": out_shape,
            "output_bytes": nbytes(out) // _PROBE_BATCHES[0],  # side tensors travel too
            "saved_bytes": per_sample,
            "saved_fixed_bytes": fixed,
            "saves_input": large.input_key in large.saved,
            "saves_output": large.output_key in large.saved,
            "largest_activation_bytes": largest_activation,
            "flops": flops,
            "backward_bytes": backward[0],
            "backward_fixed_bytes": backward[1],
            "first_backward_bytes": first[0],
            "first_backward_fixed_bytes": first[1],
            "kernel_setup_bytes": first[2] + backward[2],
            "first_kernel_setup_bytes": first[2],
        }
    finally:
        module.train(was_training)


def profile_module(
    module: nn.Module,
    input_shape: Sequence[int],
    batch_size: int | None = None,
    input_range: tuple[int, int] | None = None,
    side: Side = (),
) -> BlockProfile:
    """Profile one module for inputs of ``input_shape`` (without the batch dimension).

    ``batch_size`` is the batch the profile is for: the backward working set is measured at it,
    since kernel buffers do not grow linearly with the batch. ``input_range``: the module takes
    int64 token ids in [low, high) (a model's first block), not floats. ``side``: examples
    (batch 1) of the weight-free tensors that reach it with its input (a multi-tensor cut).
    """
    shape = tuple(int(d) for d in input_shape)
    measured = _measure(module, shape, batch_size, input_range, side)
    params = list(module.parameters())
    return BlockProfile(
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        largest_param_bytes=max((p.numel() * p.element_size() for p in params), default=0),
        input_shape=shape,
        input_bytes=(4 if input_range is None else 8) * math.prod(shape)
        + sum(t.numel() * t.element_size() for t in side),
        summary=_summary(module),
        **measured,
    )


def profile_model(
    model: SplittableModel,
    local_losses: Iterable[str] = LOCAL_LOSSES,
    batch_size: int | None = None,
    config: ModelConfig | None = None,
) -> ModelProfile:
    """Profile every block of ``model`` and every local-loss head at every cut, for training
    at ``batch_size`` (any batch when ``None``, less precisely). With ``config``, the section
    ``model`` was built from, each block's cold kernel setup is measured too, in a process of
    its own that built the model (a fork per distinct block, about 0.1 s each, of one fresh
    interpreter: :mod:`split_models.cold_setup`): what a segment starting mid-model pays on its
    device."""
    check_norm_batch(model.blocks, batch_size)
    blocks: list[BlockProfile] = []
    shape = model.input_shape
    ids = model.options.input_range
    keys = []
    for block, crossing in zip(model.blocks, _side_tensors(model), strict=True):
        blocks.append(profile_module(block, shape, batch_size, ids, crossing))
        keys.append(repr((repr(block), shape, [tuple(t.shape) for t in crossing])))
        shape, ids = blocks[-1].output_shape, None
    if config is not None and peak_supported():
        from split_models.config import config_to_dict

        section = json.dumps(config_to_dict(config))
        blocks = [
            replace(profile, first_cold_kernel_setup_bytes=first, cold_kernel_setup_bytes=whole)
            for profile, (first, whole) in zip(
                blocks, cold_setups(section, keys, batch_size), strict=True
            )
        ]
    heads: dict[str, tuple[BlockProfile, ...]] = {}
    for kind in local_losses:
        at_cut = [
            profile_module(
                make_head(
                    kind, blocks[cut - 1].output_shape, model.num_classes, model.per_position
                ),
                blocks[cut - 1].output_shape,
                batch_size,
            )
            for cut in range(1, model.num_blocks + 1)
        ]
        heads[kind] = (at_cut[0], *at_cut)
    labels = 8 * math.prod(model.label_shape)
    return ModelProfile(
        model.name, model.input_shape, model.num_classes, tuple(blocks), heads, labels
    )


def _side_tensors(model: SplittableModel) -> list[Side]:
    """For each block, the side tensors reaching it with its input (from one valid example:
    a mask computed from real ids, not from random floats)."""
    return [(), *(side(value) for value in model.cut_values()[:-1])]
