"""Stacked client segments: each slot of a SegmentStack trains exactly as its own Segment would
(the equivalence the batched simulation relies on), and a StepGroup serves concurrent clients."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from simulation.stack import SegmentStack, StepGroup, stackable
from split_models.segment import OptimizerConfig, Segment
from split_models.weights import segment_state
from split_models.zoo import build_model

pytestmark = pytest.mark.unit

SHAPES = {"cnn": (1, 8, 8), "mlp": (1, 28, 28), "resnet8": (3, 32, 32)}


def _double(segment: Segment) -> Segment:
    """In float64: float32 results vary run to run in their last bits (MKL's kernels follow
    the buffers' alignment), which three Adam steps amplified past the tolerance. The
    optimizer, holding no state yet, steps the same parameters, converted in place."""
    segment.module.double()
    if segment.head is not None:
        segment.head.double()
    return segment


def _segments(
    name: str, optimizer: str, count: int, head_lr_scale: float = 1.0, **bounds: float
) -> list[Segment]:
    nesterov = optimizer == "nesterov"  # sgd-momentum with nesterov: true
    config = OptimizerConfig(
        "sgd-momentum" if nesterov else optimizer,
        lr=0.01,
        weight_decay=0.01,
        head_lr_scale=head_lr_scale,
        nesterov=nesterov,
        **bounds,
    )
    return [
        _double(
            Segment.from_model(
                build_model(name, SHAPES[name], 10, seed=seed), 0, 2, "linear", config
            )
        )
        for seed in range(count)
    ]


def _assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-7, atol=1e-9, err_msg=key)


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize(
    ("model", "lr_scale", "head"), [("cnn", 1.0, 1.0), ("mlp", 1.0, 1.0), ("cnn", 0.3, 10.0)]
)
def test_each_slot_trains_as_its_own_segment(
    model: str, optimizer: str, lr_scale: float, head: float
) -> None:
    """Stacked slots step as their own segments would, with a round's decay and a local head
    at its own rate (``head_lr_scale``) too."""
    reference = _segments(model, optimizer, 3, head)
    stack = SegmentStack(_segments(model, optimizer, 4, head)[3], slots=4)
    for segment in (*reference, stack.segment):  # a round's decay (set on the template)
        segment.lr_scale = lr_scale
    for slot, segment in enumerate(reference):
        stack.load(slot, segment_state(segment))
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        xs = torch.randn(3, 8, *SHAPES[model], generator=generator, dtype=torch.float64)
        ys = torch.randint(0, 10, (3, 8), generator=generator)
        active = [0, 2] if step == 1 else [0, 1, 2]  # slot 1 sits one step out
        outputs, losses = stack.step(active, xs[active], ys[active])
        for i, slot in enumerate(active):
            want = reference[slot].train_step(xs[slot], ys[slot])
            torch.testing.assert_close(outputs[i], want.output, atol=1e-9, rtol=1e-7)
            assert losses[i] == pytest.approx(want.loss, rel=1e-7, abs=1e-9)
    for slot, segment in enumerate(reference):
        _assert_same_weights(stack.state(slot), segment_state(segment))


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw"])
@pytest.mark.parametrize(
    "bounds",
    [
        {"max_step": 0.002},
        {"clip_norm": 0.3},
        {"warmup_steps": 2},
        {"warmup_steps": 1, "max_step": 0.002},
    ],
)
def test_slots_bound_their_steps_as_their_own_segments(
    optimizer: str, bounds: dict[str, float]
) -> None:
    """``max_step`` and ``clip_norm`` (tight enough here to bind on every step) scale each
    slot's gradients by its own factor, and warm-up ramps each slot's rate over its own
    first steps, as each segment's step does."""
    reference = _segments("cnn", optimizer, 3, 3.0, **bounds)
    unbounded = _segments("cnn", optimizer, 1, 3.0)[0]
    stack = SegmentStack(_segments("cnn", optimizer, 4, 3.0, **bounds)[3], slots=3)
    for slot, segment in enumerate(reference):
        stack.load(slot, segment_state(segment))
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        # slot 1's inputs are far larger: its factor differs from the others'
        scale = torch.tensor([1.0, 30.0, 1.0]).view(3, 1, 1, 1, 1)
        xs = torch.randn(3, 8, *SHAPES["cnn"], generator=generator, dtype=torch.float64) * scale
        ys = torch.randint(0, 10, (3, 8), generator=generator)
        active = [0, 1] if step == 0 else [0, 1, 2]  # slot 2 starts a step late
        stack.step(active, xs[active], ys[active])
        for slot in active:
            reference[slot].train_step(xs[slot], ys[slot])
        unbounded.train_step(xs[0], ys[0])
    for slot, segment in enumerate(reference):
        _assert_same_weights(stack.state(slot), segment_state(segment))
    moved = segment_state(unbounded)
    assert any(  # the bound took part: without it slot 0 ends elsewhere
        not np.allclose(stack.state(0)[key], moved[key], atol=1e-4) for key in moved
    )


def test_every_optimizer_option_stacks() -> None:
    options = {"max_step": 0.05, "clip_norm": 1.0, "warmup_steps": 10}
    assert stackable(_segments("cnn", "sgd-momentum", 1, **options)[0])


def test_loading_a_slot_clears_its_optimizer_state() -> None:
    fresh, used = _segments("cnn", "adam", 2)
    stack = SegmentStack(_segments("cnn", "adam", 3)[2], slots=1)
    x, y = torch.randn(1, 4, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (1, 4))
    stack.load(0, segment_state(used))
    stack.step([0], x, y)
    stack.load(0, segment_state(fresh))  # a new round: new weights, no moments
    stack.step([0], x, y)
    fresh.train_step(x[0], y[0])
    _assert_same_weights(stack.state(0), segment_state(fresh))


def test_segments_with_batch_norm_are_not_stacked() -> None:
    segment = _segments("resnet8", "sgd", 1)[0]
    assert not stackable(segment)
    with pytest.raises(ValueError, match="BatchNorm"):
        SegmentStack(segment, slots=2)


def test_a_step_group_serves_concurrent_clients_of_different_lengths() -> None:
    reference = _segments("cnn", "sgd-momentum", 3)
    group = StepGroup(SegmentStack(_segments("cnn", "sgd-momentum", 4)[3], slots=3))
    lengths = [4, 2, 3]  # clients finish at different steps; the others go on without them
    generator = torch.Generator().manual_seed(1)
    data = [
        [
            (
                torch.randn(6, 1, 8, 8, generator=generator, dtype=torch.float64),
                torch.randint(0, 10, (6,)),
            )
            for _ in range(n)
        ]
        for n in lengths
    ]
    slots = [group.join(segment_state(segment)) for segment in reference]
    results: dict[int, dict[str, np.ndarray]] = {}

    def client(index: int) -> None:
        for x, y in data[index]:
            group.train_step(slots[index], x, y)
        results[index] = group.leave(slots[index])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    for index, segment in enumerate(reference):
        for x, y in data[index]:
            segment.train_step(x, y)
        _assert_same_weights(results[index], segment_state(segment))
    with pytest.raises(ValueError, match="slots are taken"):
        for _ in range(4):
            group.join(segment_state(reference[0]))


def test_a_model_with_dropout_stacks_with_a_mask_per_slot() -> None:
    # vmap's default refuses random operations: every stacked client of such a model failed
    model = build_model("tests.fixtures.user_models:with_dropout", (1, 8, 8), 10, seed=0)
    stack = SegmentStack(Segment.from_model(model, 0, 4, "linear", OptimizerConfig("sgd")), 2)
    for slot in range(2):
        stack.load(slot, segment_state(stack.segment))
    inputs = torch.ones(2, 8, 1, 8, 8)  # the same batch in both slots, the same weights
    outputs, losses = stack.step([0, 1], inputs, torch.zeros(2, 8, dtype=torch.long))
    assert all(np.isfinite(losses))
    assert not torch.equal(outputs[0], outputs[1]), "each slot draws a mask of its own"
