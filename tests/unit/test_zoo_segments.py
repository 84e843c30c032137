"""Zoo models, user models, local-loss heads and segment equivalence."""

from __future__ import annotations

import itertools

import pytest
import torch

from split_models import (
    LOCAL_LOSSES,
    ConfigError,
    ModelError,
    OptimizerConfig,
    Segment,
    build_model,
    make_head,
)
from split_models.heads import supervised_contrastive_loss
from split_models.options import ModelOptions

pytestmark = pytest.mark.unit

MODELS = [("mlp", (1, 8, 8)), ("cnn", (1, 28, 28)), ("cnn", (1, 8, 8)), ("resnet8", (3, 16, 16))]


@pytest.mark.parametrize(("name", "shape"), MODELS)
def test_zoo_models_produce_logits(name: str, shape: tuple[int, ...]) -> None:
    model = build_model(name, shape, num_classes=7, seed=0)
    with torch.no_grad():
        logits = model.full().eval()(torch.randn(3, *shape))
    assert logits.shape == (3, 7)


def test_resnet_depths() -> None:
    assert build_model("resnet20", (3, 8, 8), 10).num_blocks == 11
    with pytest.raises(ConfigError, match="6n\\+2"):
        build_model("resnet10", (3, 8, 8), 10)


@pytest.mark.parametrize(("name", "shape"), MODELS)
def test_any_composition_of_segments_equals_the_full_model(
    name: str, shape: tuple[int, ...]
) -> None:
    model = build_model(name, shape, 10, seed=1)
    model.full().eval()
    x = torch.randn(4, *shape)
    with torch.no_grad():
        expected = model.full()(x)
        for cuts in [(1,), (model.num_blocks - 1,), tuple(range(1, model.num_blocks))]:
            bounds = [0, *cuts, model.num_blocks]
            out = x
            for start, end in itertools.pairwise(bounds):
                out = model.segment(start, end)(out)
            assert torch.equal(out, expected), f"cuts {cuts}"


def test_user_model_by_import_path() -> None:
    model = build_model("tests.fixtures.user_models:tiny", (1, 4, 4), 3)
    assert model.num_blocks == 4
    assert build_model("tests.fixtures.user_models:as_list", (1, 8, 8), 10).num_blocks == 2


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("tests.fixtures.user_models:not_a_model", ModelError, "returned int"),
        ("tests.fixtures.user_models:missing", ModelError, "no callable named 'missing'"),
        ("no_such_package.mod:f", ModelError, "cannot import module"),
        (
            "tests.fixtures.user_models:raises",
            ModelError,
            r"tests.fixtures.user_models:raises\(\) raised RuntimeError: boom in user code",
        ),
        (
            "tests.fixtures.fails_at_import:f",
            ModelError,
            "importing 'tests.fixtures.fails_at_import' raised RuntimeError: this module fails",
        ),
        ("vgg", ConfigError, "neither a zoo model"),
    ],
)
def test_bad_user_models(path: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build_model(path, (1, 8, 8), 10)


@pytest.mark.parametrize(
    ("name", "shape"), [*MODELS, ("tests.fixtures.user_models:as_list", (1, 8, 8))]
)
def test_split_points_on_a_model_in_fixed_blocks_are_refused_not_ignored(
    name: str, shape: tuple[int, ...]
) -> None:
    marks = ModelOptions(split_points=("nonexistent",))
    with pytest.raises((ConfigError, ModelError), match=r"split_points: .*(fixed|list of) blocks"):
        build_model(name, shape, 10, options=marks)
    assert build_model(name, shape, 10).num_blocks >= 2  # the blocks it comes in


def test_bad_shapes_and_classes() -> None:
    with pytest.raises(ConfigError, match="input_shape"):
        build_model("cnn", (28, 28), 10)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("mlp", (1, 8, 8), 1)
    with pytest.raises(ModelError, match="outside"):
        build_model("mlp", (1, 8, 8), 10).segment(2, 9)


@pytest.mark.parametrize("kind", LOCAL_LOSSES)
def test_segment_trains_on_local_loss_without_gradient_crossing_back(kind: str) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", (1, 8, 8), 4, seed=0)
    segment = Segment.from_model(model, 0, 2, kind, OptimizerConfig("adam", lr=0.01))
    x = torch.randn(32, 1, 8, 8, requires_grad=True)
    y = torch.arange(32) % 4
    first = segment.train_step(x, y)
    for _ in range(30):
        last = segment.train_step(x, y)
    assert x.grad is None, "no gradient may flow into the segment's input"
    assert not first.output.requires_grad
    assert first.output.shape == (32, 32, 4, 4)
    assert last.loss < first.loss


def test_last_segment_uses_task_loss_and_next_segment_trains_on_detached_output() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    front = Segment.from_model(model, 0, 2, "mlp")
    back = Segment.from_model(model, 2, model.num_blocks)
    assert back.is_last and not front.is_last
    x, y = torch.randn(16, 1, 8, 8), torch.arange(16) % 10
    result = back.train_step(front.train_step(x, y).output, y)
    assert result.output.shape == (16, 10)
    assert result.loss == pytest.approx(
        torch.nn.functional.cross_entropy(
            model.segment(2, 4)(front.forward(x)) * 0 + result.output, y
        ).item(),
        abs=1e-6,
    )


def test_reset_optimizer_drops_momentum_so_a_step_after_new_weights_starts_fresh() -> None:
    x, y = torch.randn(16, 1, 8, 8), torch.arange(16) % 4

    def step_change(reset: bool) -> torch.Tensor:
        model = build_model("cnn", (1, 8, 8), 4, seed=0)
        segment = Segment.from_model(model, 0, 2, "linear", OptimizerConfig("sgd-momentum"))
        segment.train_step(x, y)
        assert segment.optimizer.state, "momentum buffers exist after a step"
        if reset:
            segment.reset_optimizer()
            assert not segment.optimizer.state
        before = segment.trainable_parameters()[0].detach().clone()
        segment.train_step(x, y)
        return segment.trainable_parameters()[0].detach() - before

    fresh = build_model("cnn", (1, 8, 8), 4, seed=0)
    first = Segment.from_model(fresh, 0, 2, "linear", OptimizerConfig("sgd-momentum"))
    before = first.trainable_parameters()[0].detach().clone()
    first.train_step(x, y)
    first_change = first.trainable_parameters()[0].detach() - before
    # without momentum a step is -lr * grad; with stale momentum it is larger
    assert step_change(reset=True).norm() < step_change(reset=False).norm()
    assert step_change(reset=True).norm() == pytest.approx(first_change.norm().item(), rel=0.5)


def test_supcon_loss_prefers_clustered_embeddings() -> None:
    labels = torch.tensor([0, 0, 1, 1])
    clustered = torch.nn.functional.normalize(
        torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]), dim=1
    )
    mixed = clustered[[0, 2, 1, 3]]
    assert supervised_contrastive_loss(clustered, labels) < supervised_contrastive_loss(
        mixed, labels
    )
    lonely = supervised_contrastive_loss(clustered, torch.tensor([0, 1, 2, 3]))
    assert lonely.item() == 0.0


def test_heads_validate_kind_and_optimizer() -> None:
    with pytest.raises(ConfigError, match="local_loss"):
        make_head("hinge", (8,), 10)
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        OptimizerConfig("lbfgs")
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        OptimizerConfig(lr=0)


def narrow(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A user model with 7 outputs whatever num_classes says (a user's slip)."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 7))


def needs_depth(depth: int, num_classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))


def test_a_user_model_whose_output_does_not_fit_num_classes_is_named() -> None:
    """It crashed the first evaluation with an IndexError ("Target 9 is out of bounds")."""
    from split_models import ModelError, build_model

    here = "tests.unit.test_zoo_segments"
    with pytest.raises(ModelError, match=r"outputs shape \[1, 7\].*needs \[1, 10\]"):
        build_model(f"{here}:narrow", (1, 8, 8), 10, seed=0)
    assert build_model(f"{here}:narrow", (1, 8, 8), 7, seed=0).num_classes == 7
    with pytest.raises(ModelError, match=r"needs_depth\(\) needs depth, which edgesplit"):
        build_model(f"{here}:needs_depth", (1, 8, 8), 10, seed=0)
