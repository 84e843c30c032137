"""Training-memory estimate of a segment, from a :class:`ModelProfile` (pure, no torch).

For blocks ``[start, end)`` plus the loss head, trained at ``batch_size`` with an optimizer:

- weights: parameters and buffers of the blocks and the head;
- gradients: one tensor per parameter;
- optimizer state: none (SGD), one copy (momentum), two copies plus a per-tensor temporary (Adam);
- input: the batch and its int64 labels;
- activations: what autograd saves for backward, counted once per storage, plus the output;
- transient: what the worst block adds on top at its busiest moment: its measured working set
  (gradient buffers, kernel workspaces, weight-gradient copies; without an input gradient for
  the first block) and the gradient arriving at its output, while only the blocks before it
  hold saved activations.

The benchmark ``benchmarks/memory.py`` checks this against the measured peak of a real step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from split_models.errors import ConfigError
from split_models.profiler import BlockProfile, ModelProfile
from split_models.segment import OPTIMIZERS

__all__ = ["MemoryEstimate", "estimate_segment_memory", "segment_memory_table"]

_LABEL_BYTES = 8
_OPTIMIZER_COPIES = {"sgd": 0, "sgd-momentum": 1, "adam": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs, by component; ``total`` is the estimated peak."""

    weights: int
    gradients: int
    optimizer_state: int
    input: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.gradients
            + self.optimizer_state
            + self.input
            + self.activations
            + self.transient
        )

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


class _Chain:
    """Accumulates blocks ``start, start+1, ...`` so every ``[start, end)`` costs O(1) more.

    Activations saved by blocks after ``k`` do not exist yet in block ``k``'s forward and are
    already freed in its backward, so the step's peak is the largest, over blocks ``k``, of
    what blocks ``<= k`` saved plus block ``k``'s measured working set and incoming gradient.
    """

    def __init__(self, batch: int, optimizer: str) -> None:
        self.batch, self.copies, self.adam = (
            batch,
            _OPTIMIZER_COPIES[optimizer],
            optimizer == "adam",
        )
        self.first: BlockProfile | None = None
        self.last: BlockProfile | None = None
        self.params = self.buffers = self.largest_param = 0
        self.saved = 0  # bytes for the whole batch, including parts that do not scale
        self.peak = 0  # the largest saved-so-far + working set over the blocks so far

    def _extend(self, block: BlockProfile) -> tuple[int, int]:
        """Saved bytes and working-set bytes (whole batch) of ``block`` after the chain."""
        batch = self.batch
        saved = block.saved_bytes
        if self.last is None:
            working = batch * block.first_backward_bytes + block.first_backward_fixed_bytes
        else:
            working = batch * block.backward_bytes + block.backward_fixed_bytes
            if block.saves_input and not self.last.saves_output:
                saved += block.input_bytes
        working += batch * block.output_bytes  # the gradient arriving at the block's output
        return batch * saved + block.saved_fixed_bytes, working

    def add(self, block: BlockProfile) -> None:
        saved, working = self._extend(block)
        self.first = self.first or block
        self.params += block.param_bytes
        self.buffers += block.buffer_bytes
        self.largest_param = max(self.largest_param, block.largest_param_bytes)
        self.saved += saved
        self.peak = max(self.peak, self.saved + working)
        self.last = block

    def estimate(self, head: BlockProfile | None) -> MemoryEstimate:
        """The estimate of the chain so far, closed by ``head`` (or by the task loss)."""
        if self.first is None or self.last is None:
            raise ConfigError("an empty segment has no memory estimate")
        params, buffers, largest_param = self.params, self.buffers, self.largest_param
        saved, peak, tail = self.saved, self.peak, self.last
        if head is not None:
            head_saved, head_working = self._extend(head)
            params, buffers = params + head.param_bytes, buffers + head.buffer_bytes
            largest_param = max(largest_param, head.largest_param_bytes)
            saved += head_saved
            peak, tail = max(peak, saved + head_working), head
        if not tail.saves_output:
            saved += self.batch * tail.output_bytes  # the output handed on (or the logits)
        return MemoryEstimate(
            weights=params + buffers,
            gradients=params,
            optimizer_state=self.copies * params + (largest_param if self.adam else 0),
            input=self.batch * (self.first.input_bytes + _LABEL_BYTES),
            activations=saved,
            transient=max(0, peak - saved),
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


def estimate_segment_memory(
    profile: ModelProfile,
    start: int,
    end: int,
    batch_size: int,
    optimizer: str,
    local_loss: str | None = "linear",
) -> MemoryEstimate:
    """Estimated peak bytes to train blocks ``[start, end)`` and their head for one step.

    ``local_loss`` names the head used when ``end`` is not the last block; the last segment
    always uses the task loss. ``None`` means no head (backprop mode: the gradient arrives
    from the next stage).
    """
    if not 0 <= start < end <= profile.num_blocks:
        raise ConfigError(f"segment [{start}, {end}) is outside 0..{profile.num_blocks} blocks")
    _validate(profile, batch_size, optimizer, local_loss)
    chain = _Chain(batch_size, optimizer)
    for block in profile.blocks[start:end]:
        chain.add(block)
    return chain.estimate(_head(profile, end, local_loss))


def segment_memory_table(
    profile: ModelProfile, batch_size: int, optimizer: str, local_loss: str | None = "linear"
) -> list[list[int]]:
    """``table[start][end]`` = estimated peak bytes of segment ``[start, end)`` (0 if empty).

    Equal to :func:`estimate_segment_memory` for every segment, in O(N^2) instead of O(N^3).
    """
    _validate(profile, batch_size, optimizer, local_loss)
    size = profile.num_blocks + 1
    table = [[0] * size for _ in range(size)]
    for start in range(profile.num_blocks):
        chain = _Chain(batch_size, optimizer)
        for end in range(start + 1, size):
            chain.add(profile.blocks[end - 1])
            table[start][end] = chain.estimate(_head(profile, end, local_loss)).total
    return table
