"""Training-memory estimate of a segment, from a :class:`ModelProfile` (pure, no torch).

For blocks ``[start, end)`` plus the loss head, trained at ``batch_size`` with an optimizer,
memory that lives through the whole step:

- weights: parameters and buffers of the blocks and the head;
- optimizer state: none (SGD), one copy (momentum), two copies plus two temporaries the size of
  the largest parameter (Adam's step); with FedProx (``anchor``) one more copy of the
  trainable weights, the round's weights its proximal term pulls towards;
- input: the batch and its int64 labels;
- kernel setup: what the first step at this batch size leaves resident (generated kernels,
  primitive caches, the library code pages they run), measured per block in order and cold
  (see ``_Chain.add``);
- bookkeeping: a constant 96 KiB for the step's autograd graph and Python objects;

and the step's own peak, the largest of its phases:

- forward/backward at block ``k``: what blocks before ``k`` saved for backward, block ``k``'s
  measured training pass (its saved tensors, incoming and outgoing gradient buffers, kernel
  workspaces, its own weight gradients; without an input gradient for the first block), and the
  weight gradients of the blocks after ``k``, which backward has already produced;
- the end of forward: all saved activations and the output handed on;
- the optimizer step: all weight gradients;

plus an allocator allowance of 6% on the step peak (see ``ALLOCATOR_ALLOWANCE``).

The benchmark ``benchmarks/memory.py`` checks this against the measured peak of a real step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from split_models.errors import ConfigError
from split_models.options import ADAMS, OPTIMIZER_STATES
from split_models.profiler import BlockProfile, ModelProfile
from split_models.segment import OPTIMIZERS

__all__ = ["MemoryEstimate", "estimate_segment_memory", "segment_memory_table"]

_LABEL_BYTES = 8
# The step peak composed from per-block probes misses what only a whole step shows: page
# rounding and mmap headers of many live tensors, heap fragmentation. benchmarks/memory.py
# measured that as a 0-10% shortfall (median 5%) on every zoo model; this allowance covers it.
ALLOCATOR_ALLOWANCE = 0.06
# One training step also allocates what no block profile sees: the autograd graph's nodes, the
# step's Python objects and the heap pages they touch. On segments of 5-130 KiB of weights the
# benchmark's meter measured 0-42 KiB above the estimate without this term over three steps, and
# segments of 1-2 MiB crept up by a further 0-90 KiB over 20-30 steps (the heap growing as steps
# interleave). (The meter read a floor of about 100 KiB before it stopped over-reading peaks
# still resident when read.)
STEP_BOOKKEEPING_BYTES = 96 * 1024


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs; ``total`` is the estimated peak.

    ``weights``, ``optimizer_state``, ``input``, ``kernel_setup`` and ``bookkeeping`` live
    through the step;
    ``step_peak`` is the
    peak of everything the step allocates. ``gradients`` (all weight gradients) and
    ``activations`` (all saved activations) are parts of it, shown for explanation: they are
    not all live at the same moment, so they are not added up.
    """

    weights: int
    optimizer_state: int
    input: int
    kernel_setup: int
    bookkeeping: int
    step_peak: int
    gradients: int
    activations: int

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.optimizer_state
            + self.input
            + self.kernel_setup
            + self.bookkeeping
            + self.step_peak
        )

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


class _Chain:
    """Accumulates blocks ``start, start+1, ...`` so every ``[start, end)`` costs O(1) more.

    The backward peak at block ``k`` is ``saved(< k) + pass(k) + grads(> k)``. Keeping
    ``saved(< k) + pass(k) - params(<= k)`` as a running maximum turns it into
    ``max + params(all)`` once the chain is closed.
    """

    def __init__(
        self, batch: int, optimizer: str, label_bytes: int = _LABEL_BYTES, anchor: bool = False
    ) -> None:
        self.batch, self.copies, self.adam = (
            batch,
            OPTIMIZER_STATES[optimizer] + anchor,
            optimizer in ADAMS,
        )
        self.label_bytes = label_bytes
        self.first: BlockProfile | None = None
        self.last: BlockProfile | None = None
        self.params = self.buffers = self.largest_param = 0
        self.saved = 0  # bytes for the whole batch, including parts that do not scale
        self.setup = 0  # max over k of cold setup(k) + in-order setups of the blocks after k
        self.relative_peak = -(2**62)  # max over k of saved(< k) + pass(k) - params(<= k)

    def _extend(self, block: BlockProfile) -> tuple[int, int, int]:
        """Saved, training-pass and kernel-setup bytes (whole batch) of ``block`` after the
        chain; the setup is the chain's with ``block`` added."""
        batch = self.batch
        saved = block.saved_bytes
        if self.last is None:
            per_sample, fixed = block.first_backward_bytes, block.first_backward_fixed_bytes
            setup, cold = block.first_kernel_setup_bytes, block.first_cold_kernel_setup_bytes
        else:
            per_sample, fixed = block.backward_bytes, block.backward_fixed_bytes
            setup, cold = block.kernel_setup_bytes, block.cold_kernel_setup_bytes
            if block.saves_input and not self.last.saves_output:
                saved += block.input_bytes
        saved_total = batch * saved + block.saved_fixed_bytes
        # Setup is what the blocks' first passes need between them (kernels, caches, library
        # code pages), shared where blocks run the same kernels. In order, a block's setup
        # leaves out what any earlier block of the model made; cold, it counts what it shares
        # with the segment's other blocks. Their union is at least a block's cold setup plus
        # what each later block of the segment added in order (disjoint from it).
        return saved_total, saved_total + batch * per_sample + fixed, max(self.setup + setup, cold)

    def add(self, block: BlockProfile) -> None:
        saved, training_pass, setup = self._extend(block)
        self.setup = setup
        self.first = self.first or block
        self.params += block.param_bytes
        self.buffers += block.buffer_bytes
        self.largest_param = max(self.largest_param, block.largest_param_bytes)
        self.relative_peak = max(self.relative_peak, self.saved + training_pass - self.params)
        self.saved += saved
        self.last = block

    def estimate(self, head: BlockProfile | None, incoming: bool = False) -> MemoryEstimate:
        """The estimate of the chain so far, closed by ``head`` (or by the task loss);
        ``incoming``: the next segment's gradient of the output arrives and is kept through
        the whole backward pass (backprop mode, a segment before the last)."""
        if self.first is None or self.last is None:
            raise ConfigError("an empty segment has no memory estimate")
        params, buffers, largest_param = self.params, self.buffers, self.largest_param
        saved, relative_peak, tail, setup = self.saved, self.relative_peak, self.last, self.setup
        gradient_in = self.batch * self.last.output_bytes if incoming and head is None else 0
        if head is not None:
            head_saved, head_pass, setup = self._extend(head)
            params, buffers = params + head.param_bytes, buffers + head.buffer_bytes
            largest_param = max(largest_param, head.largest_param_bytes)
            relative_peak = max(relative_peak, saved + head_pass - params)
            saved, tail = saved + head_saved, head
        if not tail.saves_output:
            saved += self.batch * tail.output_bytes  # the output handed on (or the logits)
        return MemoryEstimate(
            weights=params + buffers,
            # Adam's per-tensor loop computes (exp_avg_sq.sqrt() / c).add_(eps): two
            # temporaries the size of the parameter being updated are alive at once. The fused
            # kernel (the CPU's and CUDA's) makes none; kept, so the estimate holds on any device.
            optimizer_state=self.copies * params + (2 * largest_param if self.adam else 0),
            input=self.batch * (self.first.input_bytes + self.label_bytes),
            kernel_setup=setup,
            bookkeeping=STEP_BOOKKEEPING_BYTES,
            step_peak=math.ceil(
                (1 + ALLOCATOR_ALLOWANCE)
                * max(relative_peak + params + gradient_in, saved + gradient_in, params)
            ),
            gradients=params,
            activations=saved,
        )


def _validate(
    profile: ModelProfile, batch_size: int, optimizer: str, local_loss: str | None
) -> None:
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer: unknown {optimizer!r}; use one of {OPTIMIZERS}")
    if batch_size < 1:
        raise ConfigError(f"batch_size: must be >= 1, got {batch_size}")
    if local_loss is not None and local_loss not in profile.heads:
        raise ConfigError(
            f"local_loss: {local_loss!r} was not profiled; profiled kinds: {sorted(profile.heads)}"
        )


def _head(profile: ModelProfile, end: int, local_loss: str | None) -> BlockProfile | None:
    if end == profile.num_blocks or local_loss is None:
        return None
    return profile.heads[local_loss][end]


def _incoming(profile: ModelProfile, end: int, local_loss: str | None) -> bool:
    """Whether a segment ending at ``end`` receives its output's gradient (backprop mode)."""
    return local_loss is None and end < profile.num_blocks


def estimate_segment_memory(
    profile: ModelProfile,
    start: int,
    end: int,
    batch_size: int,
    optimizer: str,
    local_loss: str | None = "linear",
    anchor: bool = False,
) -> MemoryEstimate:
    """Estimated peak bytes to train blocks ``[start, end)`` and their head for one step.

    ``local_loss`` names the head used when ``end`` is not the last block; the last segment
    always uses the task loss. ``None`` means no head (backprop mode: the gradient arrives
    from the next stage). ``anchor``: FedProx's copy of the round's weights is kept too.
    """
    if not 0 <= start < end <= profile.num_blocks:
        raise ConfigError(f"segment [{start}, {end}) is outside 0..{profile.num_blocks} blocks")
    # the last segment has the task loss: which local head was profiled does not matter
    _validate(profile, batch_size, optimizer, local_loss if end < profile.num_blocks else None)
    chain = _Chain(batch_size, optimizer, profile.label_bytes, anchor)
    for block in profile.blocks[start:end]:
        chain.add(block)
    return chain.estimate(_head(profile, end, local_loss), _incoming(profile, end, local_loss))


def segment_memory_table(
    profile: ModelProfile,
    batch_size: int,
    optimizer: str,
    local_loss: str | None = "linear",
    anchor: bool = False,
) -> list[list[int]]:
    """``table[start][end]`` = estimated peak bytes of segment ``[start, end)`` (0 if empty).

    Equal to :func:`estimate_segment_memory` for every segment, in O(N^2) instead of O(N^3).
    """
    _validate(profile, batch_size, optimizer, local_loss)
    size = profile.num_blocks + 1
    table = [[0] * size for _ in range(size)]
    for start in range(profile.num_blocks):
        chain = _Chain(batch_size, optimizer, profile.label_bytes, anchor)
        for end in range(start + 1, size):
            chain.add(profile.blocks[end - 1])
            head, incoming = _head(profile, end, local_loss), _incoming(profile, end, local_loss)
            table[start][end] = chain.estimate(head, incoming).total
    return table
