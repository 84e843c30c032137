"""A trainable segment: blocks ``[start, end)`` of a model, a loss head and an optimizer.

``train_step`` trains the segment on one batch with its own loss and returns the detached output
activations, so the next segment can train on them without any gradient crossing back.
``train_from`` is the same step entered at any block of the segment (a GPU server continues
each edge's batch from that edge's cut), optionally returning the gradient of the input for a
``backprop``-mode sender.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import get_total_norm

from split_models.activations import Activation, detached, primary, side
from split_models.errors import ModelError
from split_models.heads import LocalHead, TaskLoss, make_head
from split_models.options import OPTIMIZERS as OPTIMIZERS
from split_models.options import OptimizerConfig as OptimizerConfig
from split_models.randomness import RandomStream, apart
from split_models.zoo import SplittableModel

__all__ = ["OPTIMIZERS", "OptimizerConfig", "Segment", "StepResult", "Suspended", "step_factors"]


class NonFiniteLoss(ModelError):
    """A batch whose loss is NaN or infinite: the segment took no step on it."""


def step_factors(
    squares: torch.Tensor, scales: torch.Tensor, lr: torch.Tensor | float, config: OptimizerConfig
) -> torch.Tensor:
    """The factors gradients are scaled by before a step at ``lr``, one per leading index of
    ``squares`` (a segment's: none, a stack's: one a slot): ``squares[..., g]`` is the squared
    norm of parameter group ``g``'s gradients and ``scales[g]`` its multiple of the rate.
    ``clip_norm`` bounds the gradients' norm, ``max_step`` the norm of the step a plain SGD
    step would take, each group at its own rate; NaN where the norm is not finite."""
    total = squares.sum(-1).sqrt()
    factors = torch.ones_like(total)
    if config.clip_norm is not None:
        factors = torch.minimum(factors, config.clip_norm / (total + 1e-6))  # as clip_grad_norm_
    if config.max_step is not None:
        step = (squares * scales * scales).sum(-1).sqrt()
        factors = torch.minimum(factors, config.max_step / lr / (step + 1e-6))
    return torch.where(total.isfinite(), factors, torch.nan)


@dataclass(frozen=True)
class StepResult:
    """The detached output of a training step and the loss it was trained on; with
    ``input_gradient=True`` also the gradient of the loss with respect to the step's input."""

    output: Activation  # a tensor, or (activation, *side tensors) at a multi-tensor cut
    loss: float
    input_gradient: torch.Tensor | None = None  # of the activation (side tensors take none)


@dataclass
class Suspended:
    """A client's round on a segment, taken out for another's (:meth:`Segment.suspend`)."""

    tensors: list[torch.Tensor]
    optimizer: dict[Any, Any]
    steps: int


class Segment:
    """Blocks ``[start, end)`` with their loss head (local, or the task loss for the last)."""

    def __init__(
        self,
        module: nn.Module,
        head: LocalHead | TaskLoss,
        optimizer: OptimizerConfig,
        start: int,
        end: int,
    ) -> None:
        self.module = module
        self.head = head
        self.start, self.end = start, end
        self.optimizer_config = optimizer
        self._optimizer: torch.optim.Optimizer | None = None  # built on first use
        self.proximal_mu = 0.0
        self.side_outputs = 0  # weight-free tensors crossing the cut after it with its output
        self._anchor: list[torch.Tensor] = []
        self._steps = 0  # optimizer steps since the round began (for the warm-up)
        # the round's factor of the learning rate (OptimizerConfig.round_scale), set by the
        # edge, GPU server or baseline that trains the round
        self.lr_scale = 1.0
        # a bound on the round's steps of the blocks (not the local head), besides the
        # optimizer's own bounds, set per round: an edge's first round at a new cut
        # (edge_client.jobs.Job.max_step)
        self.step_bound: float | None = None
        # where its training draws random numbers (dropout) from, set per round by its trainer
        # (split_models.randomness); None: torch's generator as it stands, under the lock
        self.random: RandomStream | None = None
        self._outside = RandomStream()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Built on first use: a segment that only holds or evaluates weights (a
        coordinator's, an export's) never loads what torch's optimizers import (``torch._dynamo``:
        1.4 s of a coordinator's restart in a fresh process)."""
        if self._optimizer is None:
            head = list(self.head.parameters())
            self._optimizer = self.optimizer_config.build(self.trainable_parameters(), head)
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    @classmethod
    def from_model(
        cls,
        model: SplittableModel,
        start: int,
        end: int,
        local_loss: str = "linear",
        optimizer: OptimizerConfig | None = None,
    ) -> Segment:
        """Segment of ``model`` sharing its parameters; the last segment gets the task loss.
        Its head's weights and the pass that finds its shape draw from torch's generator as it
        stands, apart from the training threads' streams (:func:`apart`)."""
        with apart():
            return cls._from_model(model, start, end, local_loss, optimizer)

    @classmethod
    def _from_model(
        cls,
        model: SplittableModel,
        start: int,
        end: int,
        local_loss: str,
        optimizer: OptimizerConfig | None,
    ) -> Segment:
        module = model.segment(start, end)
        head: LocalHead | TaskLoss = TaskLoss()
        side_outputs = 0
        if end < model.num_blocks:
            with torch.no_grad():
                feature_shape, side_outputs = _output_shape(model, end)
            head = make_head(local_loss, feature_shape, model.num_classes, model.per_position)
        segment = cls(module, head, optimizer or OptimizerConfig(), start, end)
        segment.side_outputs = side_outputs
        return segment

    @property
    def is_last(self) -> bool:
        return isinstance(self.head, TaskLoss)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [*self.module.parameters(), *self.head.parameters()]

    def reset_optimizer(self, proximal_mu: float = 0.0) -> None:
        """Begin a round on the weights just loaded: drop the optimizer's state (momentum,
        Adam moments), restart the warm-up, and with ``proximal_mu > 0`` anchor FedProx's
        proximal term ``mu / 2 * ||w - w_round||^2`` at these weights.

        Called when a round replaces the weights with the aggregate: state accumulated on the
        previous round's local weights points the wrong way for the new ones, and carrying it
        over makes federated rounds unstable.
        """
        if proximal_mu < 0 or proximal_mu != proximal_mu:
            raise ValueError(f"proximal_mu: must be >= 0, got {proximal_mu}")
        if self._optimizer is not None:
            self._optimizer.state.clear()
        self._steps = 0
        self.proximal_mu = float(proximal_mu)
        params = self.trainable_parameters()
        self._anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else []

    def _step(self) -> float:
        """The optimizer step on the gradients just computed, with the proximal term's
        gradient ``mu * (w - w_round)`` added, the clipping and the warm-up applied; returns
        the factor the clip scaled the gradients by (1.0 when it did not)."""
        params = self.trainable_parameters()
        if self._anchor:
            with torch.no_grad():
                for param, anchor in zip(params, self._anchor, strict=True):
                    if param.grad is not None:
                        param.grad.add_(param - anchor, alpha=self.proximal_mu)
        config = self.optimizer_config
        lr = config.lr_at(self._steps) * self.lr_scale
        factor = self._clip_factor(lr)
        if factor != 1.0:  # clipped; or NaN: a gradient that is not finite turns all NaN, as
            with torch.no_grad():  # clip_grad_norm_ made it (the guard refuses such weights)
                for param in params:
                    if param.grad is not None:
                        param.grad.mul_(factor)
        if self.step_bound is not None:
            self._bound_blocks(lr, self.step_bound)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        self.optimizer.step()
        self._steps += 1
        return factor if math.isfinite(factor) else 1.0

    def _bound_blocks(self, lr: float, bound: float) -> None:
        """Clip the blocks' gradients (not the local head's) so that a plain SGD step at
        ``lr`` moves the blocks by at most ``bound``: the head at a new cut, fresh, learns
        freely while its first gradients cannot wreck the blocks it reads (bounding the head
        too kept it untrained, and the next, unbounded round wrecked them instead)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        with torch.no_grad():
            norm = float(get_total_norm(grads))
            if math.isfinite(norm) and norm * lr > bound:
                for grad in grads:
                    grad.mul_(bound / lr / (norm + 1e-6))

    def _clip_factor(self, lr: float) -> float:
        """What the gradients are scaled by before a step at ``lr`` (NaN when their norm is
        not finite): ``clip_norm`` bounds their norm, ``max_step`` the norm of the whole step
        a plain SGD step would take, each group's gradients times its ``lr_scale``: a local
        head's faster rate (``OptimizerConfig.head_scale``) counts, so a reached bound
        shortens the blocks' steps too."""
        config = self.optimizer_config
        if config.clip_norm is None and config.max_step is None:
            return 1.0
        groups = [
            (group.get("lr_scale", 1.0), grads)
            for group in self.optimizer.param_groups
            if (grads := [p.grad for p in group["params"] if p.grad is not None])
        ]
        if not groups:
            return 1.0
        with torch.no_grad():  # one norm per group (as clip_grad_norm_ takes it), read at once
            norms = torch.stack([get_total_norm(grads) for _, grads in groups]).double()
        scales = norms.new_tensor([scale for scale, _ in groups])
        return float(step_factors(norms * norms, scales, lr, config))

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers of the blocks and the head."""
        modules = (self.module, self.head)
        return [t for m in modules for t in (*m.parameters(), *m.buffers())]

    def suspend(self) -> Suspended:
        """This round's training so far (weights, buffers, optimizer state, steps), taken out
        so that another client can train its round on the segment: :meth:`resume` puts it
        back. The optimizer's state moves out, so the next client starts on none."""
        state = dict(self._optimizer.state) if self._optimizer is not None else {}
        if self._optimizer is not None:
            self._optimizer.state.clear()
        return Suspended([t.detach().clone() for t in self.state_tensors()], state, self._steps)

    def resume(self, suspended: Suspended) -> None:
        """Go on with the training :meth:`suspend` took out (the same round: FedProx's anchor,
        the round's weights, is the one set then)."""
        with torch.no_grad():
            for tensor, kept in zip(self.state_tensors(), suspended.tensors, strict=True):
                tensor.copy_(kept)
        if suspended.optimizer:
            self.optimizer.state.clear()
            self.optimizer.state.update(suspended.optimizer)
        elif self._optimizer is not None:
            self._optimizer.state.clear()
        self._steps = suspended.steps

    def train_step(self, inputs: Activation, labels: torch.Tensor) -> StepResult:
        """One optimizer step on the segment's own loss; no gradient leaves the segment."""
        return self.train_from(self.start, inputs, labels)

    def train_from(
        self,
        block: int,
        inputs: Activation,
        labels: torch.Tensor,
        input_gradient: bool = False,
        finite_only: bool = False,
    ) -> StepResult:
        """One optimizer step on the segment's own loss (its local head, or the task loss
        for the last segment) for a batch entering at global block ``block`` (``inputs`` are
        the output of block ``block - 1``); blocks before ``block`` take no part. With
        ``input_gradient`` the result carries the loss's gradient of ``inputs`` (backprop
        mode: the sender back-propagates it through its own blocks), scaled by the factor
        the clip scaled this segment's gradients by, so the sender's blocks step as those of
        one clipped model would. With ``finite_only``
        a batch whose loss is not finite raises :class:`NonFiniteLoss` without a step (a
        server does so for batches from the network; an edge steps and its NaN weights leave
        it out of the round)."""
        if not self.start <= block < self.end:
            raise ValueError(
                f"block: a batch enters segment [{self.start}, {self.end}) at a block in "
                f"that range, got {block}; send it to the segment that holds block {block}"
            )
        self.module.train()
        self.head.train()
        self.optimizer.zero_grad(set_to_none=True)
        inputs = detached(inputs, input_gradient)
        output = inputs
        with self._drawing(block):
            for child in list(self.module.children())[block - self.start :]:
                output = child(output)
            loss = self.head.loss(primary(output), labels)
        if finite_only and not bool(torch.isfinite(loss)):  # a step would make weights NaN
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(
                f"the loss of this batch is NaN or infinite ({float(loss)}); no step was taken"
            )
        loss.backward()  # type: ignore[no-untyped-call]
        factor = self._step()
        grad = primary(inputs).grad
        gradient = grad.detach() if input_gradient and grad is not None else None
        if gradient is not None and factor < 1.0:
            gradient = gradient * factor
        return StepResult(detached(output), float(loss.detach()), gradient)

    def forward_for_backprop(self, inputs: Activation) -> Activation:
        """Backprop mode, first half of a step: the output with its graph, for a gradient
        that comes from the next segment (the local head is not used)."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self._drawing("backprop"):
            return self.module(detached(inputs))  # type: ignore[no-any-return]

    def _drawing(self, way: object) -> contextlib.AbstractContextManager[None]:
        """A forward pass entering by ``way``, drawing from this round's stream if set."""
        return (self.random or self._outside).drawing(way)

    def backward_from(self, output: Activation, gradient: torch.Tensor) -> None:
        """Backprop mode, second half: back-propagate the next segment's gradient (of the
        activation; side tensors carry none) and step."""
        primary(output).backward(gradient)  # type: ignore[no-untyped-call]
        self._step()

    @torch.no_grad()
    def forward(self, inputs: Activation) -> Activation:
        """Inference through the segment's blocks only (the head is not applied)."""
        self.module.eval()
        return self.module(inputs)  # type: ignore[no-any-return]


def _output_shape(model: SplittableModel, end: int) -> tuple[tuple[int, ...], int]:
    """The shape (without the batch) of the activation after block ``end - 1``, and how many
    side tensors cross that cut with it."""
    probe = model.segment(0, end)
    was_training = probe.training
    probe.eval()
    try:
        output = probe(model.example_input(1, zeros=True))
        return tuple(primary(output).shape[1:]), len(side(output))
    finally:
        probe.train(was_training)
