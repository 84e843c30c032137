"""Many replicas of one segment trained in one call: batched client segments on a shared device.

A simulation host trains many clients whose segments have the same blocks (same cut) but their
own weights and optimizer state. Stepping them one by one issues many small kernels; on a GPU
they leave the device idle. A :class:`SegmentStack` keeps ``slots`` replicas as stacked
tensors (``[slots, ...]`` per parameter) and trains any subset of them with one vmapped forward
and backward (``torch.func``) and one optimizer update, each slot exactly as its own
:class:`~split_models.segment.Segment` would be trained (SGD, momentum and Adam as
``torch.optim`` implements them, per-slot step counts). A :class:`StepGroup` gathers the steps
that concurrent client threads ask for and runs them together.

Models with buffers (BatchNorm's running statistics) are not stacked: their replicas would
update shared statistics under vmap; such segments train one by one, as do segments whose cut
carries side tensors (an attention mask beside the activation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from split_models.options import ADAMS, OPTIMIZER_STATES
from split_models.randomness import RandomStream
from split_models.segment import OptimizerConfig, Segment, StepResult, step_factors
from split_models.weights import load_segment_state, segment_state

__all__ = ["SegmentStack", "StepGroup", "stackable"]


def stackable(segment: Segment) -> bool:
    """Whether ``segment`` can be stacked: no buffers, a loss that vmap can batch (every
    optimizer option steps stacked: clipping, the step bound, warm-up) and one tensor at its
    cut (side tensors such as a mask are not stacked yet)."""
    modules = (segment.module, segment.head)
    no_buffers = not any(True for m in modules for _ in m.buffers())
    per_position = getattr(segment.head, "per_position", False)
    kind = getattr(segment.head, "kind", "")
    single = segment.side_outputs == 0
    return no_buffers and single and not per_position and kind in ("linear", "mlp", "task")


class _Loss(nn.Module):
    """The segment and its head as one module whose forward returns (loss, output)."""

    def __init__(self, segment: Segment) -> None:
        super().__init__()
        self.module, self.head = segment.module, segment.head

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = self.module(inputs)
        return self.head.loss(output, labels), output


class SegmentStack:
    """``slots`` replicas of ``segment`` (blocks and head) with their own weights and
    optimizer state, trained together."""

    def __init__(self, segment: Segment, slots: int, device: str = "cpu") -> None:
        if not stackable(segment):
            raise ValueError(
                "segments with buffers (BatchNorm) or a supcon head cannot be stacked; "
                "train them one by one"
            )
        if slots < 1:
            raise ValueError(f"slots: expected an integer >= 1, got {slots}")
        self.segment, self.slots = segment, slots
        self._random = RandomStream()  # torch's generator as it stands, under its lock
        self.optimizer: OptimizerConfig = segment.optimizer_config
        self.device = torch.device(device)
        self._loss = _Loss(segment)
        self._loss.train()
        named = dict(self._loss.named_parameters())
        self.params = {
            k: p.detach().to(self.device).unsqueeze(0).repeat_interleave(slots, 0)
            for k, p in named.items()
        }
        copies = OPTIMIZER_STATES[self.optimizer.name]
        self._state = [
            {k: torch.zeros_like(p) for k, p in self.params.items()} for _ in range(copies)
        ]
        self._steps = torch.zeros(slots, dtype=torch.float64, device=self.device)

        def loss(
            params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            value, output = functional_call(self._loss, params, (x, y))
            return value, output

        # each client its own dropout masks, as when they train one by one (the default,
        # 'error', failed every stacked client of a model with dropout)
        self._batched = vmap(grad_and_value(loss, has_aux=True), randomness="different")

    # ---------------------------------------------------------------- slots
    def load(self, slot: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Set ``slot``'s weights from global-named arrays and clear its optimizer state."""
        load_segment_state(self.segment, arrays)  # validates names and shapes
        for name, parameter in self._loss.named_parameters():
            self.params[name][slot] = parameter.detach().to(self.device)
        for state in self._state:
            for tensor in state.values():
                tensor[slot] = 0
        self._steps[slot] = 0

    def state(self, slot: int) -> dict[str, np.ndarray]:
        """``slot``'s weights under their global names."""
        with torch.no_grad():
            for name, parameter in self._loss.named_parameters():
                parameter.copy_(self.params[name][slot])
        return segment_state(self.segment)

    # ---------------------------------------------------------------- training
    def step(
        self, slots: Sequence[int], inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, list[float]]:
        """One training step of each of ``slots`` on its own batch (``inputs[i]``,
        ``labels[i]``, all batches of one size); the detached outputs (on the CPU, for the
        wire) and the losses."""
        index = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
        params = {k: v[index] for k, v in self.params.items()}
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        with self._random.drawing():  # apart from the other threads' streams (the lock)
            grads, (losses, outputs) = self._batched(params, inputs, labels)
        self._update(index, params, grads)
        return outputs.detach().cpu(), [float(v) for v in losses.cpu()]

    @torch.no_grad()
    def _update(
        self,
        index: torch.Tensor,
        params: dict[str, torch.Tensor],
        grads: dict[str, torch.Tensor],
    ) -> None:
        config = self.optimizer
        # the round's decay: the agent sets it on the template, which every slot shares (the
        # clients of one stack train the same round)
        steps = self._steps[index] + 1  # each slot's step, from 1
        self._steps[index] = steps
        # each slot's rate: warm-up as OptimizerConfig.lr_at ramps it over its first steps
        warm = (steps / (config.warmup_steps + 1)).clamp(max=1.0)
        lr = config.lr * self.segment.lr_scale * warm
        factors = self._clip_factors(grads, lr)
        for name, param in params.items():
            grad = grads[name]
            shape = (-1,) + (1,) * (param.dim() - 1)
            if factors is not None:
                grad = grad * factors.view(shape)
            scale = config.head_scale() if name.startswith("head.") else 1.0
            rate = (lr * scale).to(param.dtype).view(shape)
            if config.weight_decay and config.name == "adamw":  # decoupled from the moments
                param = param * (1 - rate * config.weight_decay)
            elif config.weight_decay:
                grad = grad + config.weight_decay * param
            if config.name in ADAMS:
                first, second = self._state[0][name], self._state[1][name]
                m = 0.9 * first[index] + 0.1 * grad
                v = 0.999 * second[index] + 0.001 * grad * grad
                first[index], second[index] = m, v
                bias1 = (1 - 0.9**steps).to(param.dtype).view(shape)
                bias2 = (1 - 0.999**steps).to(param.dtype).view(shape)
                denom = v.sqrt() / bias2.sqrt() + 1e-8
                param = param - (rate / bias1) * m / denom
            elif config.name == "sgd-momentum":
                buffer = self._state[0][name]
                update = config.momentum * buffer[index] + grad
                buffer[index] = update
                if config.nesterov:  # torch's: the gradient plus the momentum it leads to
                    update = grad + config.momentum * update
                param = param - rate * update
            else:
                param = param - rate * grad
            self.params[name][index] = param

    def _clip_factors(
        self, grads: dict[str, torch.Tensor], lr: torch.Tensor
    ) -> torch.Tensor | None:
        """Each slot's factor on its gradients (:func:`~split_models.segment.step_factors`, as
        each segment's step takes it, blocks and head as its two parameter groups); None
        without ``clip_norm`` or ``max_step``. ``lr``: each slot's rate."""
        config = self.optimizer
        if config.clip_norm is None and config.max_step is None:
            return None
        first = next(iter(grads.values()))
        squares = torch.zeros(first.shape[0], 2, dtype=torch.float64, device=first.device)
        for name, grad in grads.items():  # each slot's sum of squares: blocks, then the head
            squares[:, int(name.startswith("head."))] += grad.flatten(1).double().pow(2).sum(1)
        scales = squares.new_tensor([1.0, config.head_scale()])
        return step_factors(squares, scales, lr, config).to(first.dtype)


class StepGroup:
    """Runs the steps that client threads ask for together: a step waits until every member
    still training has asked (or ``wait`` seconds passed since the first asked), then one
    :meth:`SegmentStack.step` per batch size serves them all."""

    def __init__(self, stack: SegmentStack, wait: float = 0.005) -> None:
        self.stack, self.wait = stack, wait
        self._lock = threading.Condition()
        self._members: set[int] = set()
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._results: dict[int, StepResult | BaseException] = {}
        self._free = list(range(stack.slots))
        self.calls = self.client_steps = 0  # stacked steps run, and the client steps in them

    def join(self, arrays: Mapping[str, np.ndarray]) -> int:
        """A slot for a client's round, loaded with its weights (None free: ValueError)."""
        with self._lock:
            if not self._free:
                raise ValueError(f"all {self.stack.slots} slots are taken")
            slot = self._free.pop()
            self.stack.load(slot, arrays)
            self._members.add(slot)
            return slot

    def leave(self, slot: int) -> dict[str, np.ndarray]:
        """End ``slot``'s round: its weights, and the slot back to the free list."""
        with self._lock:
            self._members.discard(slot)
            state = self.stack.state(slot)
            self._free.append(slot)
            self._lock.notify_all()  # the others may be waiting only for this member
            return state

    def train_step(self, slot: int, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        """``slot``'s step, run together with the other members' pending steps."""
        with self._lock:
            self._pending[slot] = (inputs, labels)
            deadline = time.monotonic() + self.wait
            while slot not in self._results:
                remaining = deadline - time.monotonic()
                if self._members <= set(self._pending) or remaining <= 0:
                    self._run_pending()
                else:
                    self._lock.wait(remaining)
            result = self._results.pop(slot)
        if isinstance(result, BaseException):
            raise result
        return result

    def _run_pending(self) -> None:
        """Step every pending slot, grouped by batch shape (called with the lock held)."""
        pending, self._pending = self._pending, {}
        groups: dict[tuple[int, ...], list[int]] = {}
        for slot, (inputs, _labels) in pending.items():
            groups.setdefault(tuple(inputs.shape), []).append(slot)
        for slots in groups.values():
            try:
                inputs = torch.stack([pending[s][0] for s in slots])
                labels = torch.stack([pending[s][1] for s in slots])
                outputs, losses = self.stack.step(slots, inputs, labels)
                self.calls += 1
                self.client_steps += len(slots)
                for i, slot in enumerate(slots):
                    self._results[slot] = StepResult(outputs[i], losses[i])
            except Exception as error:  # each waiting client gets the failure, none hangs
                for slot in slots:
                    self._results[slot] = error
        self._lock.notify_all()
