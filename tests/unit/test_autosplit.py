"""Automatic splitting: any nn.Module becomes blocks whose composition is the module."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from split_models import split_point
from split_models.autosplit import auto_blocks
from split_models.config import ModelConfig
from split_models.errors import ConfigError, ModelError
from split_models.isolated import profile_in_fresh_process
from split_models.profiler import ModelProfile
from split_models.segment import OptimizerConfig, Segment
from split_models.zoo import ModelOptions, build_model
from tests.fixtures import gallery

pytestmark = pytest.mark.unit

TOKENS = ModelOptions("int64", (0, gallery.VOCAB))
GALLERY = {
    "lenet": ((1, 28, 28), None),
    "resnet18_narrow": ((3, 32, 32), None),
    "mobilenet_like": ((3, 32, 32), None),
    "lstm_classifier": ((16,), TOKENS),
    "transformer_classifier": ((16,), TOKENS),
}


def _fresh_profile(
    name: str, shape: tuple[int, ...], classes: int, options: ModelOptions | None
) -> ModelProfile:
    """Profiled in a child process, as the coordinator does: in this test process's large
    heap, the cycle collections that profiling traced blocks needs take minutes."""
    spec = ModelConfig(f"tests.fixtures.gallery:{name}", shape, classes)
    if options is not None:
        spec = dataclasses.replace(
            spec,
            input_dtype=options.input_dtype,
            input_range=options.input_range,
            task=options.task,
        )
    return profile_in_fresh_process(spec, ("linear",), 8)


def _composed_matches(module: nn.Module, blocks: list[nn.Module], x: torch.Tensor) -> None:
    """Forward and every parameter's gradient of the blocks in sequence equal the module's."""
    composed = nn.Sequential(*blocks)
    module.train()
    torch.manual_seed(0)
    expected = module(x)
    expected.square().mean().backward()  # type: ignore[no-untyped-call]
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    torch.manual_seed(0)
    actual = composed(x)
    actual.square().mean().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert grads, "the module has no gradients to compare"
    for name, p in module.named_parameters():
        if name in grads:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-5)


def test_resnet18_split_automatically_equals_the_unsplit_model() -> None:
    torch.manual_seed(0)
    model = gallery.resnet18((3, 32, 32), 10)
    blocks = auto_blocks(model, torch.zeros(2, 3, 32, 32))
    # stem, the eight residual blocks, the classifier: a residual is never cut inside
    assert len(blocks) == 10
    x = torch.randn(4, 3, 32, 32)
    # BatchNorm in training mode updates running stats; compare on fresh copies of them
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _composed_matches(model, blocks, x)
    model.load_state_dict(state)


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_every_gallery_model_splits_into_blocks_whose_composition_is_the_model(name: str) -> None:
    shape, options = GALLERY[name]
    model = build_model(f"tests.fixtures.gallery:{name}", shape, 10, seed=0, options=options)
    assert model.num_blocks >= 3
    owned = [id(p) for block in model.blocks for p in block.parameters()]
    assert len(owned) == len(set(owned)), "a parameter belongs to two blocks"
    with torch.no_grad():
        torch.manual_seed(1)
        x = model.example_input(3)
        for block in model.blocks:
            block.eval()
        assert model.full()(x).shape == (3, 10)


def test_token_models_profile_with_valid_ids_and_no_block_with_weights_has_zero_flops() -> None:
    for name in ("lstm_classifier", "transformer_classifier"):
        shape, options = GALLERY[name]
        model = build_model(f"tests.fixtures.gallery:{name}", shape, 10, seed=0, options=options)
        profile = _fresh_profile(name, shape, 10, options)
        assert profile.blocks[0].input_bytes == 8 * 16  # int64 ids
        for block, module in zip(profile.blocks, model.blocks, strict=True):
            if any(True for _ in module.parameters()):
                assert block.flops > 0, (name, block.summary)


def test_split_point_calls_restrict_the_cuts_to_the_marked_ones() -> None:
    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = split_point(F.relu(self.a(x)))
            return self.c(F.relu(self.b(x)))  # type: ignore[no-any-return]

    blocks = auto_blocks(Marked(), torch.zeros(2, 8))
    assert [len(list(b.parameters())) for b in blocks] == [2, 4]


def test_split_points_by_module_name_and_a_mark_that_is_not_a_legal_cut() -> None:
    model = gallery.resnet18_narrow((3, 32, 32), 10)
    blocks = auto_blocks(model, torch.zeros(2, 3, 32, 32), ["layer3", "fc"])
    assert len(blocks) == 3
    with pytest.raises(ModelError, match="not a legal cut"):
        auto_blocks(
            gallery.resnet18_narrow((3, 32, 32), 10), torch.zeros(2, 3, 32, 32), ["layer1.0.conv2"]
        )
    with pytest.raises(ModelError, match="no module named 'layer9'"):
        auto_blocks(gallery.resnet18_narrow((3, 32, 32), 10), torch.zeros(2, 3, 32, 32), ["layer9"])


def test_tied_weights_are_never_cut_apart(caplog: pytest.LogCaptureFixture) -> None:
    """A model left in one block was refused by the planner without the reason (GPT-2's
    tied embeddings): the reason is said."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mid = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.embed(x))
            x = torch.relu(self.mid(x))
            return F.linear(x, self.embed.weight)  # the first layer's weight, again

    with caplog.at_level(logging.WARNING, logger="split_models.autosplit"):
        blocks = auto_blocks(Tied(), torch.zeros(2, 6))
    assert len(blocks) == 1
    assert "Tied: no cut between embed and linear, which share a weight" in caplog.text


def test_a_block_may_start_with_an_in_place_relu() -> None:
    # torchvision's children in a Sequential: a block begins with ReLU(inplace=True)
    blocks = [nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 3))]
    model = build_model("tests.fixtures.user_models:tiny", (4,), 3)
    model.blocks = nn.ModuleList(blocks)
    from split_models.autosplit import disable_inplace

    for block in model.blocks:
        disable_inplace(block)
    segment = Segment.from_model(model, 1, 2, optimizer=OptimizerConfig("sgd"))
    inputs = torch.randn(5, 8)
    kept = inputs.clone()
    result = segment.train_from(1, inputs, torch.zeros(5, dtype=torch.long), input_gradient=True)
    assert result.input_gradient is not None
    torch.testing.assert_close(inputs, kept)  # the sender's tensor is untouched


def test_user_factories_returning_sequential_with_in_place_layers_are_made_safe() -> None:
    model = build_model("tests.fixtures.user_models:inplace_children", (4,), 3)
    assert not any(getattr(m, "inplace", False) for m in model.full().modules())


def test_models_that_cannot_be_split_are_named_with_the_fix() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow
                return self.a(x)  # type: ignore[no-any-return]
            return x

    with pytest.raises(ModelError, match=r"cannot trace Branchy.forward.*submodule"):
        auto_blocks(Branchy(), torch.zeros(2, 4))

    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    with pytest.raises(ModelError, match="needs more than one input"):
        auto_blocks(TwoInputs(), torch.zeros(2, 4))

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.a(x)
            return y, y

    with pytest.raises(ModelError, match="must return one tensor"):
        auto_blocks(Pair(), torch.zeros(2, 4))


def test_integer_inputs_need_their_range() -> None:
    with pytest.raises(ConfigError, match="input_range"):
        ModelOptions("int64")
    with pytest.raises(ConfigError, match="low < high"):
        ModelOptions("int64", (5, 5))


_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _torchvision_models() -> object:
    try:
        import torchvision.models

        return torchvision.models
    except Exception as error:  # a CUDA build next to the CPU torch fails at import
        pytest.skip(f"torchvision does not import here: {error}")


@pytest.mark.skipif(not _TORCHVISION, reason="torchvision is not installed (pip install .[vision])")
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_models_split_unchanged(name: str) -> None:
    models = _torchvision_models()
    torch.manual_seed(0)
    model = getattr(models, name)(num_classes=10)
    blocks = auto_blocks(model, torch.zeros(2, 3, 32, 32))
    assert len(blocks) >= 5
    _composed_matches(model, blocks, torch.randn(4, 3, 32, 32))


@pytest.mark.skipif(not _TORCHVISION, reason="torchvision is not installed (pip install .[vision])")
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_the_gallery_copies_are_torchvisions_definitions(name: str) -> None:
    """The gallery's copies (tested where torchvision does not import) compute what
    torchvision's models compute with the same weights, under the same names."""
    models = _torchvision_models()
    original = getattr(models, name)(num_classes=10).eval()
    copy = getattr(gallery, name)((3, 32, 32), 10).eval()
    shapes = {key: tuple(value.shape) for key, value in original.state_dict().items()}
    assert {key: tuple(value.shape) for key, value in copy.state_dict().items()} == shapes
    copy.load_state_dict(original.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(copy(x), original(x))


def test_mobilenet_v3_small_splits_unchanged() -> None:
    torch.manual_seed(0)
    model = gallery.mobilenet_v3_small((3, 32, 32), 10)
    blocks = auto_blocks(model, torch.zeros(2, 3, 32, 32))
    assert len(blocks) >= 10  # a cut after every inverted residual, none inside one
    _composed_matches(model, blocks, torch.randn(4, 3, 32, 32))


def test_a_language_model_trains_per_position_across_a_cut() -> None:
    options = ModelOptions("int64", (0, gallery.VOCAB), task="language-model")
    model = build_model("tests.fixtures.gallery:tiny_gpt", (12,), gallery.VOCAB, 0, options)
    assert model.label_shape == (12,)
    ids = model.example_input(4)
    labels = torch.roll(ids, -1, dims=1)
    front = Segment.from_model(model, 0, 2, "linear")
    step = front.train_step(ids, labels)
    assert step.output.shape == (4, 12, 32)  # hidden states at every position cross the cut
    back = Segment.from_model(model, 2, model.num_blocks)
    assert back.train_step(step.output, labels).loss > 0
    with pytest.raises(ConfigError, match="token per position"):
        Segment.from_model(model, 0, 2, "supcon")
    profile = _fresh_profile("tiny_gpt", (12,), gallery.VOCAB, options)
    assert profile.label_bytes == 8 * 12  # the labels travel and sit in memory per position
    with pytest.raises(ConfigError, match="language-model takes token ids"):
        ModelOptions(task="language-model")


def test_a_forward_with_optional_arguments_is_traced_at_their_defaults() -> None:
    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(
            self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0
        ) -> torch.Tensor:
            if mask is not None:
                x = x * mask
            return self.b(torch.relu(self.a(x))) * scale  # type: ignore[no-any-return]

    model = Optional()
    blocks = auto_blocks(model, torch.zeros(2, 4))
    assert len(blocks) == 2
    x = torch.randn(3, 4)
    torch.testing.assert_close(nn.Sequential(*blocks)(x), model(x))


@pytest.mark.parametrize("name", ["pair_input", "dict_input"])
def test_a_model_of_several_inputs_is_named_in_one_line(
    name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A tuple model raised an "unexpected IndexError"; both printed fx's traceback first."""
    with pytest.raises(ModelError, match="needs a wrapper module that builds it from one"):
        build_model(f"tests.fixtures.user_models:{name}", (1, 4, 4), 3, seed=0)
    assert "Traceback" not in capfd.readouterr().err


class _FunctionalDropout(nn.Module):
    """Dropout as a function of the module's mode, the way many models write it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.a(x.flatten(1))), 0.5, self.training)
        h = F.dropout(torch.relu(self.b(h)), p=0.3, training=self.training)
        return self.c(h)


def _assert_blocks_follow_their_mode(model: nn.Module, x: torch.Tensor) -> None:
    """The model's blocks compute as the model in eval mode (no dropout: the same output
    twice) and draw dropout in train mode (two outputs differ)."""
    torch.manual_seed(0)
    blocks = auto_blocks(model, torch.zeros(2, *x.shape[1:]))

    def run() -> torch.Tensor:
        out = x
        for block in blocks:
            out = block(out)
        return out

    for block in blocks:
        block.eval()
    assert torch.equal(run(), run()), "no dropout in evaluation (a trace had fixed it on)"
    assert torch.allclose(run(), model.eval()(x), atol=1e-6)
    for block in blocks:
        block.train()
    assert not torch.equal(run(), run()), "dropout in training"


def test_a_forward_passing_self_training_follows_each_blocks_mode() -> None:
    _assert_blocks_follow_their_mode(_FunctionalDropout(), torch.randn(16, 1, 8, 8))


def test_a_forward_branching_on_self_training_is_refused_by_name() -> None:
    class Branching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x.flatten(1))
            if self.training:
                h = h + torch.randn_like(h)
            return self.b(h)

    with pytest.raises(ModelError, match=r"branches on self\.training"):
        auto_blocks(Branching(), torch.zeros(2, 1, 8, 8))


def test_a_value_chosen_by_the_mode_is_chosen_when_the_block_runs() -> None:
    """nanoGPT's ``dropout_p=self.dropout if self.training else 0``: traced in train mode,
    attention kept its dropout in evaluation; refusing the model would be no better."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out, self.dropout = nn.Linear(16, 48), nn.Linear(16 * 4, 10), 0.5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x.squeeze(1)).chunk(3, dim=-1)
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
            return self.out(y.flatten(1))

    _assert_blocks_follow_their_mode(Attention(), torch.randn(8, 1, 4, 16))


def test_the_mode_flag_is_no_shared_weight_so_layers_using_it_may_be_cut_apart() -> None:
    """Every ``F.dropout(..., self.training)`` read one flag, which was taken for a weight
    shared by all of them: no cut between the first and the last dropout was legal."""
    blocks = auto_blocks(_FunctionalDropout(), torch.zeros(2, 1, 8, 8))
    assert len(blocks) == 3, [str(block.graph) for block in blocks]


def test_tensors_made_in_forward_are_one_constant_in_both_traces() -> None:
    """The eval trace named ``torch.tensor(2.0)`` ``_tensor_constant1`` (the train trace had
    taken ``_tensor_constant0``), and the model was refused as branching on its mode."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x.flatten(1)) * torch.tensor(2.0) + torch.ones(32))

    model, x = Scaled(), torch.randn(4, 1, 8, 8)
    out = x
    for block in auto_blocks(model, torch.zeros(2, 1, 8, 8)):
        out = block(out)
    assert torch.allclose(out, model(x))
    # a later instance of a traced architecture (every role builds the model more than once)
    # failed: "'Scaled' object has no attribute '_tensor_constant0'"
    key = ("scaled", uuid.uuid4())
    first, later = Scaled(), Scaled()
    auto_blocks(first, torch.zeros(2, 1, 8, 8), key=key)
    out = x
    for block in auto_blocks(later, torch.zeros(2, 1, 8, 8), key=key):
        out = block(out)
    assert torch.allclose(out, later(x))
    assert sorted(n for n in vars(model) if n.startswith("_tensor_constant")) == [
        "_tensor_constant0",
        "_tensor_constant1",
    ]


def test_tracing_leaves_each_submodule_in_the_mode_it_had() -> None:
    """A frozen part kept in eval mode was put back in train mode with the model."""
    model = _FunctionalDropout()
    model.b.eval()
    auto_blocks(model, torch.zeros(2, 1, 8, 8))
    assert model.training and model.a.training and not model.b.training


def test_profile_of_a_language_model_takes_the_heads_that_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --local-loss, `edgesplit profile` asked for supcon heads too and refused."""
    from edgesplit.cli import main

    code = main(
        [
            "profile",
            "--model",
            "tests.fixtures.gallery:tiny_gpt",
            "--input-shape",
            "12",
            "--num-classes",
            str(gallery.VOCAB),
            "--input-dtype",
            "int64",
            "--input-range",
            str(gallery.VOCAB),
            "--task",
            "language-model",
            "--json",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert set(json.loads(capsys.readouterr().out)["heads"]) == {"linear", "mlp"}
