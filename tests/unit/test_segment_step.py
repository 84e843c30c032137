"""A segment's optimizer step: FedProx's proximal term, gradient clipping, the warm-up and
the learning rate's decay across rounds."""

from __future__ import annotations

import pytest
import torch

from split_models.errors import ConfigError
from split_models.segment import OptimizerConfig, Segment
from split_models.zoo import build_model

pytestmark = pytest.mark.unit

X, Y = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 4


def _segment(optimizer: OptimizerConfig, end: int = 2) -> Segment:
    return Segment.from_model(build_model("cnn", (1, 8, 8), 4, seed=0), 0, end, "linear", optimizer)


def _trained(segment: Segment, steps: int, mu: float | None = None) -> list[torch.Tensor]:
    if mu is not None:
        segment.reset_optimizer(mu)
    for _ in range(steps):
        segment.train_step(X, Y)
    return [p.detach().clone() for p in segment.trainable_parameters()]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)) ** 0.5)


def test_proximal_term_zero_equals_plain_and_positive_pulls_towards_the_round_weights() -> None:
    config = OptimizerConfig("sgd-momentum", lr=0.05)
    start = [p.detach().clone() for p in _segment(config).trainable_parameters()]
    plain = _trained(_segment(config), 6)
    zero = _trained(_segment(config), 6, mu=0.0)
    prox = _trained(_segment(config), 6, mu=5.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero, strict=True)), "mu 0 is plain"
    assert _distance(prox, plain) > 1e-4, "mu > 0 changes the weights"
    assert _distance(prox, start) < _distance(plain, start), "and keeps them nearer the anchor"


def test_proximal_gradient_is_mu_times_the_distance_to_the_anchor() -> None:
    config = OptimizerConfig("sgd", lr=0.1)
    segment = _segment(config)
    segment.reset_optimizer(2.0)
    with torch.no_grad():  # move away from the anchor, so the term is not zero
        for param in segment.trainable_parameters():
            param.add_(0.01)
    moved = [p.detach().clone() for p in segment.trainable_parameters()]
    twin = _segment(config)
    with torch.no_grad():
        for param, value in zip(twin.trainable_parameters(), moved, strict=True):
            param.copy_(value)
    twin.train_step(X, Y)  # plain SGD from the same point
    segment.train_step(X, Y)
    heads = list(segment.head.parameters())
    for got, plain in zip(segment.trainable_parameters(), twin.trainable_parameters(), strict=True):
        # prox step = plain step - lr * mu * (w - w0), and w - w0 = 0.01 everywhere; the
        # local head steps at its scale times the rate (the default rule: 1 at lr 0.1)
        rate = 0.1 * (config.head_scale() if any(got is h for h in heads) else 1.0)
        torch.testing.assert_close(got.detach(), plain.detach() - rate * 2.0 * 0.01)


def test_clipping_bounds_the_step_and_warmup_ramps_the_learning_rate() -> None:
    start = [p.detach().clone() for p in _segment(OptimizerConfig("sgd")).trainable_parameters()]
    clipped = _trained(_segment(OptimizerConfig("sgd", lr=0.5, clip_norm=0.1, head_lr_scale=1)), 1)
    # plain SGD moves by lr * |g|; clipped |g| <= 0.1, so the step is at most 0.05 (the head
    # at the blocks' rate: clip_norm bounds the gradient, max_step the step)
    assert _distance(clipped, start) <= 0.5 * 0.1 + 1e-6
    assert _distance(_trained(_segment(OptimizerConfig("sgd", lr=0.5)), 1), start) > 0.06
    warm = OptimizerConfig("sgd", lr=0.4, warmup_steps=3)
    assert [warm.lr_at(s) for s in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    segment = _segment(warm)
    segment.train_step(X, Y)
    assert segment.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    segment.reset_optimizer()  # a new round warms up again
    segment.train_step(X, Y)
    assert segment.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("lr", [2.0, 0.5, 1e-4])
def test_max_step_bounds_the_step_at_any_learning_rate(lr: float) -> None:
    """``max_step`` clips the gradient at ``max_step / lr``: a plain SGD step moves by at most
    ``max_step`` at a high rate, and a low rate's steps, already short, are left alone."""
    start = [p.detach().clone() for p in _segment(OptimizerConfig("sgd")).trainable_parameters()]
    bounded = _trained(_segment(OptimizerConfig("sgd", lr=lr, max_step=0.02)), 1)
    plain = _trained(_segment(OptimizerConfig("sgd", lr=lr)), 1)
    if _distance(plain, start) > 0.02:  # the bound is reached: the step is cut to it
        assert _distance(bounded, start) == pytest.approx(0.02, rel=1e-3)
    else:
        assert all(torch.equal(a, b) for a, b in zip(bounded, plain, strict=True))
    assert (_distance(plain, start) > 0.02) == (lr > 1e-3), "both cases are run"
    both = _trained(_segment(OptimizerConfig("sgd", lr=lr, clip_norm=0.5, max_step=0.02)), 1)
    assert _distance(both, start) <= min(0.02, _distance(plain, start)) * (1 + 1e-3)


def test_a_rounds_step_bound_holds_the_blocks_and_leaves_the_head_free() -> None:
    """``Segment.step_bound``, an edge's first round at a new cut (coordinator.moves): the
    blocks' step is bounded, the fresh head's is not (bounded too, the head stayed untrained
    and the next, unbounded round wrecked the blocks); None trains as the optimizer says."""
    fresh = _segment(OptimizerConfig("sgd"))
    blocks = [p.detach().clone() for p in fresh.module.parameters()]
    head = [p.detach().clone() for p in fresh.head.parameters()]

    def moved(segment: Segment) -> tuple[float, float]:
        segment.train_step(X, Y)
        return (
            _distance([p.detach() for p in segment.module.parameters()], blocks),
            _distance([p.detach() for p in segment.head.parameters()], head),
        )

    bounded = _segment(OptimizerConfig("sgd", lr=2.0))
    bounded.step_bound = 0.02
    free_blocks, free_head = moved(_segment(OptimizerConfig("sgd", lr=2.0)))
    bound_blocks, bound_head = moved(bounded)
    assert free_blocks > 0.05 and bound_blocks == pytest.approx(0.02, rel=1e-3)
    assert bound_head == pytest.approx(free_head, rel=1e-6), "the head steps as it would"
    lifted = _segment(OptimizerConfig("sgd", lr=2.0))
    lifted.step_bound = None
    assert moved(lifted) == pytest.approx((free_blocks, free_head))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_decay": "linear"}, "lr_decay"),
        ({"max_step": 0.0}, "max_step"),
        ({"max_step": float("inf")}, "max_step"),
    ],
)
def test_bad_step_options_are_named(options: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig("sgd", **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="proximal_mu"):
        _segment(OptimizerConfig()).reset_optimizer(-1.0)


def test_cosine_decay_scales_each_round_and_the_segment_applies_the_scale() -> None:
    constant, cosine = OptimizerConfig("sgd", lr=0.2), OptimizerConfig("sgd", lr_decay="cosine")
    assert [constant.round_scale(r, 4) for r in range(1, 5)] == [1.0] * 4
    scales = [cosine.round_scale(r, 4) for r in range(1, 5)]
    assert scales == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    assert cosine.round_scale(5, 4) == 1.0, "a round beyond the plan (more rounds on resume)"
    start = [p.detach().clone() for p in _segment(constant).trainable_parameters()]
    full = _trained(_segment(constant), 1)
    halved = _segment(constant)
    halved.lr_scale = 0.5
    segment_steps = _trained(halved, 1)
    assert halved.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    for got, whole, first in zip(segment_steps, full, start, strict=True):
        torch.testing.assert_close(got - first, (whole - first) / 2)


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_a_clipped_back_scales_the_gradient_it_sends_by_its_clip_factor(clip: float) -> None:
    """Backprop mode: the front steps on the gradient the back sends; scaled as the back's
    own were, the two halves step as one clipped model would (unscaled, a front trained at lr
    0.1 took steps the clip kept from the back, and splitfed fell to chance)."""
    model = build_model("cnn", (1, 8, 8), 4, seed=0)
    inputs = Segment.from_model(model, 0, 2, "linear", OptimizerConfig("sgd")).forward(X)
    end = model.num_blocks

    def back(clip_norm: float | None) -> Segment:
        config = OptimizerConfig("sgd", lr=0.1, clip_norm=clip_norm)
        return Segment.from_model(
            build_model("cnn", (1, 8, 8), 4, seed=0), 2, end, "linear", config
        )

    clipped, plain = back(clip), back(None)
    got = clipped.train_from(2, inputs, Y, input_gradient=True).input_gradient
    unclipped = plain.train_from(2, inputs, Y, input_gradient=True).input_gradient
    assert got is not None and unclipped is not None
    norm = float(
        torch.linalg.vector_norm(
            torch.stack(
                [
                    torch.linalg.vector_norm(p.grad)
                    for p in plain.trainable_parameters()
                    if p.grad is not None
                ]
            )
        )
    )
    factor = min(1.0, clip / (norm + 1e-6))
    assert (factor < 0.01) == (clip < 1), (factor, norm)
    torch.testing.assert_close(got, unclipped * factor)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_the_local_head_steps_at_its_own_multiple_of_the_rate(name: str) -> None:
    """One step from the same weights: the blocks move alike whatever ``head_lr_scale``; the
    head moves ``head_lr_scale`` times as far (a plain SGD step, and Adam's first step,
    are proportional to the rate)."""
    moved = {}
    for scale in (1.0, 10.0):
        segment = _segment(OptimizerConfig(name, lr=0.01, head_lr_scale=scale))
        before = [p.detach().clone() for p in segment.trainable_parameters()]
        after = _trained(segment, 1)
        heads = {id(p) for p in segment.head.parameters()}
        params = segment.trainable_parameters()
        moved[scale] = [
            (id(p) in heads, a - b) for p, a, b in zip(params, after, before, strict=True)
        ]
    for (head, one), (_, ten) in zip(moved[1.0], moved[10.0], strict=True):
        assert torch.allclose(ten, one * (10.0 if head else 1.0), rtol=1e-4, atol=1e-7)
    assert any(head for head, _ in moved[1.0]) and not all(head for head, _ in moved[1.0])


@pytest.mark.parametrize(
    ("name", "lr", "want"),
    [
        ("sgd-momentum", 0.01, 3.0),
        ("sgd-momentum", 0.02, 3.0),
        ("sgd-momentum", 0.05, 2.0),
        ("sgd", 0.1, 1.0),
        ("sgd-momentum", 0.5, 1.0),  # never slower than the blocks
        ("adam", 1e-3, 1.0),
    ],
)
def test_by_default_sgd_heads_learn_faster_at_low_rates(name: str, lr: float, want: float) -> None:
    """Absent ``head_lr_scale``, SGD heads step at three times a low rate, capped at 0.1 and
    never below the segment's; Adam's at the segment's. A set value is used as it is."""
    assert OptimizerConfig(name, lr=lr).head_scale() == pytest.approx(want)
    assert OptimizerConfig(name, lr=lr, head_lr_scale=0.5).head_scale() == 0.5
    segment = _segment(OptimizerConfig(name, lr=lr))
    scales = [group["lr_scale"] for group in segment.optimizer.param_groups]
    assert scales == pytest.approx([1.0, want])


def test_head_lr_scale_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="head_lr_scale"):
        OptimizerConfig(head_lr_scale=0)


def test_max_step_bounds_the_whole_step_with_a_faster_head() -> None:
    start = [p.detach().clone() for p in _segment(OptimizerConfig("sgd")).trainable_parameters()]
    config = OptimizerConfig("sgd", lr=0.5, max_step=0.02, head_lr_scale=10)
    bounded = _trained(_segment(config), 1)
    assert _distance(bounded, start) == pytest.approx(0.02, rel=1e-3)


def test_a_gradient_that_is_not_finite_leaves_no_weight_finite_when_bounded() -> None:
    """As ``clip_grad_norm_`` did: a NaN anywhere makes the clip factor NaN for every
    gradient, so no weight takes a partial, unbounded step (the guard refuses the round)."""
    segment = _segment(OptimizerConfig("sgd", lr=0.1, max_step=0.05, head_lr_scale=10))
    bias = list(segment.head.parameters())[-1]
    bias.register_hook(lambda grad: grad * float("nan"))
    segment.train_step(X, Y)
    assert all(torch.isnan(p).all() for p in segment.trainable_parameters())


def test_adam_uses_the_fused_kernel_where_torch_has_one_and_steps_as_the_loop_does() -> None:
    torch.manual_seed(0)
    config = OptimizerConfig(name="adam", lr=0.01, weight_decay=0.01)
    on_cpu = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in on_cpu]
    start = [p.detach().clone() for p in on_cpu]
    fused = config.build(on_cpu, head=on_cpu[1:])
    loop = torch.optim.Adam(
        [{"params": twins[:1]}, {"params": twins[1:]}], lr=0.01, weight_decay=0.01, foreach=False
    )
    assert fused.defaults["fused"] is True
    for _ in range(5):
        grads = [torch.randn_like(p) for p in on_cpu]
        for params in (on_cpu, twins):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        fused.step()
        loop.step()
    for p, twin, first in zip(on_cpu, twins, start, strict=True):
        torch.testing.assert_close(p, twin, rtol=1e-5, atol=1e-6)
        assert (p - first).abs().min() > 1e-3  # every element moved
    elsewhere = [torch.nn.Parameter(torch.randn(2, device="meta"))]
    assert not config.build(elsewhere).defaults["fused"]  # no fused kernel there: the loop


@pytest.mark.parametrize("name", ["adam", "sgd-momentum"])
def test_a_suspended_round_resumes_as_if_no_other_client_had_stepped_between(name: str) -> None:
    # a grouped host puts a client's round aside while others train theirs on the segment
    config = OptimizerConfig(name, lr=0.01, warmup_steps=4)
    alone = _trained(_segment(config), 5, mu=0.1)
    shared = _segment(config)
    start = [t.detach().clone() for t in shared.state_tensors()]
    _trained(shared, 2, mu=0.1)
    aside = shared.suspend()
    assert not shared.optimizer.state, "the next client starts on no optimizer state"
    with torch.no_grad():  # another client: from the round's weights, its own steps
        for tensor, kept in zip(shared.state_tensors(), start, strict=True):
            tensor.copy_(kept)
    other = _trained(shared, 3, mu=0.1)
    shared.resume(aside)
    resumed = _trained(shared, 3)
    assert all(torch.equal(a, b) for a, b in zip(alone, resumed, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(other, resumed, strict=True))
