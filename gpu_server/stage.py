"""Stage compute of a GPU server: validate an activation batch for its cut and train it.

The server holds blocks ``[start, end)``; a batch cut after block ``s - 1`` (``start <= s <
end``) enters at block ``s`` and trains blocks ``[s, end)`` through
:meth:`~split_models.segment.Segment.train_from`: with the task loss on the last piece, with a
local-loss head on a piece of a chain. A backprop-mode batch (on the last piece) also yields
the gradient of its input for the sender.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from split_models.activations import Activation, primary, side, wire_names
from split_models.segment import NonFiniteLoss, OptimizerConfig, Segment, StepResult
from split_models.zoo import SplittableModel
from wire.codec import Envelope, TensorSpec
from wire.errors import WireError

__all__ = ["MAX_ACTIVATION", "BackStage", "Fill", "Part"]

# The largest magnitude an activation from the wire may hold. Finite values near float32's
# limit (3e38) pass the codec's checks but overflow the back's first layer to infinity.
MAX_ACTIVATION = 1e8


class BackStage:
    """Blocks ``[start, end)`` of ``model`` on ``device``, trained one batch at a time."""

    def __init__(
        self,
        model: SplittableModel,
        start: int,
        end: int,
        local_loss: str = "linear",
        optimizer: OptimizerConfig | None = None,
        device: str = "cpu",
        max_activation: float = MAX_ACTIVATION,
        max_rows: int = 0,
    ) -> None:
        """``max_activation``: the largest magnitude an incoming activation may hold;
        ``max_rows``: the most examples a batch may hold (the run's ``batch_size``; 0: any)."""
        if not 0 < start < end <= model.num_blocks:
            raise ValueError(
                f"blocks: a GPU server holds [start, end) with 0 < start < end <= "
                f"{model.num_blocks}, got [{start}, {end}); a server never holds block 0"
            )
        self.model, self.start, self.end = model, start, end
        self.max_activation, self.max_rows = max_activation, max_rows
        self.device = torch.device(device)
        # the last piece gets the task loss, any other a local-loss head
        self.segment = Segment.from_model(model, start, end, local_loss, optimizer=optimizer)
        self.cut_specs = _specs(model, start, end)  # probed on the CPU, before the move
        self.segment.module.to(self.device)  # in place: the optimizer keeps its parameters
        self.segment.head.to(self.device)
        # built with the piece, before its first round grants credits, not on the first batch:
        # torch's optimizers import torch._dynamo (0.6-1.4 s), a pause in the stream then
        self.segment.optimizer  # noqa: B018

    def validate(self, envelope: Envelope) -> tuple[int, list[np.ndarray], np.ndarray]:
        """The batch's cut, the tensors crossing it (the activation first) and the labels;
        :class:`WireError` when they do not fit."""
        cut = envelope.meta.get("cut")
        if isinstance(cut, bool) or not isinstance(cut, int) or cut not in self.cut_specs:
            raise WireError(
                "cut",
                f"cut {cut!r} is not one this server can continue from "
                f"({sorted(self.cut_specs)}); send it to the server holding block {cut}",
            )
        specs = self.cut_specs[cut]
        names = wire_names(len(specs))
        expected = {*names, "y"}
        if set(envelope.tensors) != expected:
            raise WireError(
                "payload",
                f"an activation batch at cut {cut} holds tensors {sorted(expected)}, got "
                f"{sorted(envelope.tensors)}",
            )
        crossing = [envelope.tensors[name] for name in names]
        y = envelope.tensors["y"]
        x = crossing[0]
        for name, spec, tensor in zip(names, specs, crossing, strict=True):
            spec.check(name, tensor)
            if tensor.shape[0] != x.shape[0]:
                raise WireError(
                    "shape",
                    f"tensor {name!r} holds {tensor.shape[0]} rows, 'x' {x.shape[0]}",
                )
        self._check_values(x, y)
        return cut, crossing, y

    def _check_values(self, x: np.ndarray, y: np.ndarray) -> None:
        """The activation's rows and magnitude and the labels, against this run's limits."""
        if x.shape[0] == 0:  # a loss over zero items is NaN and would poison the round's
            raise WireError(  # mean loss
                "shape",
                f"tensor 'x' has shape {list(x.shape)}: 0 rows, expected at least 1; an "
                "edge sends a batch of 1 or more examples",
            )
        # the memory plan is for batch_size; an epoch's last batch may hold one more (a batch
        # of one joins the one before it: split_models.data.batch_slices)
        if self.max_rows and x.shape[0] > self.max_rows + 1:
            raise WireError(
                "shape",
                f"tensor 'x' holds {x.shape[0]} rows, above the run's batch_size "
                f"{self.max_rows} (+1); an edge sends at most batch_size + 1 examples a batch",
            )
        largest = float(np.max(np.abs(x))) if x.size else 0.0
        if largest > self.max_activation:  # finite, but enough to overflow the back to NaN
            raise WireError(
                "range",
                f"tensor 'x' holds a value of magnitude {largest:.3g}, above the "
                f"{self.max_activation:.3g} an activation may have (max_activation)",
            )
        TensorSpec("int64", (x.shape[0], *self.model.label_shape)).check("y", y)
        if len(y) and (y.min() < 0 or y.max() >= self.model.num_classes):
            raise WireError(
                "labels",
                f"labels span [{y.min()}, {y.max()}], expected within "
                f"[0, {self.model.num_classes})",
            )

    def prepare(self, envelope: Envelope) -> Part:
        """Validate a batch and move it to the device (:class:`WireError` when it does not
        fit)."""
        cut, crossing, y = self.validate(envelope)
        tensors = [torch.from_numpy(t).to(self.device) for t in crossing]
        return Part(envelope, cut, tensors, torch.from_numpy(y).to(self.device))

    def step(
        self, cut: int, tensors: list[torch.Tensor], labels: torch.Tensor, backprop: bool
    ) -> StepResult:
        """One step on a batch entering at ``cut``; a loss that is not finite raises
        :class:`WireError` without a step."""
        inputs: Activation = tensors[0] if len(tensors) == 1 else tuple(tensors)
        try:
            return self.segment.train_from(cut, inputs, labels, backprop, finite_only=True)
        except NonFiniteLoss as error:
            raise WireError("non_finite", f"batch not trained: {error}") from error

    def train(self, envelope: Envelope) -> tuple[StepResult, torch.Tensor]:
        """Validate and train one batch; the step's result and the labels (on the device).
        A ``backprop`` batch on the last piece gets its input gradient in the result."""
        part = self.prepare(envelope)
        backprop = envelope.meta.get("backprop") is True and self.segment.is_last
        return self.step(part.cut, part.tensors, part.labels, backprop), part.labels

    def train_parts(self, parts: list[Part]) -> StepResult:
        """One step on several validated batches of the same cut, as one batch."""
        tensors = [torch.cat(list(t)) for t in zip(*(p.tensors for p in parts), strict=True)]
        return self.step(parts[0].cut, tensors, torch.cat([p.labels for p in parts]), False)


@dataclass
class Part:
    """A validated batch on the device: the tensors crossing its cut and its labels."""

    envelope: Envelope
    cut: int
    tensors: list[torch.Tensor]
    labels: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.labels)


class Fill:
    """Fills the server's steps up to ``rows`` examples from several senders' smaller
    batches of the same cut (local-loss: no gradient goes back, so a step may serve several
    edges). Hundreds of clients holding a few examples each would otherwise cost the server
    a step per client; a full batch still trains alone and at once."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.parts: dict[int, list[Part]] = {}  # by cut

    def add(self, part: Part) -> list[list[Part]]:
        """The groups to train now that ``part`` came (in order; often none)."""
        held = self.parts.setdefault(part.cut, [])
        ready = []
        if held and sum(p.rows for p in held) + part.rows > self.rows:
            ready.append(held[:])
            held.clear()
        held.append(part)
        if sum(p.rows for p in held) >= self.rows:
            ready.append(held[:])
            held.clear()
        return ready

    def take(self) -> list[list[Part]]:
        """What is held, by cut, to train now (the round's end); empties the fill."""
        groups = [g for _, g in sorted(self.parts.items()) if g]
        self.parts = {}
        return groups


def _specs(model: SplittableModel, start: int, end: int) -> dict[int, list[TensorSpec]]:
    """The specs of the tensors crossing each cut a batch may enter ``[start, end)`` at: the
    activation (float32), then any side tensors (a mask, position ids) with their own dtypes."""
    specs = {}
    for cut, value in enumerate(model.cut_values(zeros=True)[: end - 1], start=1):
        if start <= cut:
            tensors = (primary(value), *side(value))
            specs[cut] = [
                TensorSpec("float32" if i == 0 else str(t.numpy().dtype), (None, *t.shape[1:]))
                for i, t in enumerate(tensors)
            ]
    return specs
