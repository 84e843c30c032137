"""Layers whose forward torch.fx cannot trace (third-party layers, transformers models) are
kept whole, and the model is cut around them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from split_models.autosplit import auto_blocks
from split_models.onnx_export import export_checked
from split_models.zoo import build_model
from tests.fixtures.user_models import stateful

pytestmark = pytest.mark.unit


def test_layers_whose_forward_does_not_trace_are_kept_whole_and_cut_between() -> None:
    """Third-party layers check their input in Python (shape, dtype) and return tuples: fx
    cannot trace them, and such a model was refused whole. Each is now a block of its own."""
    model = build_model("tests.fixtures.gallery:guarded_convnet", (3, 16, 16), 10).full()
    x = torch.randn(4, 3, 16, 16)
    blocks = auto_blocks(model, x)
    kept = [b for b in blocks if any(type(m).__name__ == "_CheckedConv" for m in b.modules())]
    assert len(kept) == 3 and len(blocks) == 4, [type(c).__name__ for c in blocks]
    model.eval()
    y = x
    for block in blocks:
        y = block.eval()(y)
    assert torch.allclose(y, model(x), atol=1e-6)
    mine = {id(p) for b in blocks for p in b.parameters()}
    assert mine == {id(p) for p in model.parameters()}  # the model's own weights, shared


@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("family", ["resnet", "bert"])
def test_models_from_transformers_split_around_the_layers_that_do_not_trace(
    family: str, wrapped: bool
) -> None:
    """Unwrapped, the model returns an output object: it was refused ('must return one
    tensor'); its logits are now taken, and the rest of the object is not computed."""
    transformers = pytest.importorskip("transformers")

    class Logits(nn.Module):  # the model's output object is not a tensor: take its logits
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).logits  # type: ignore[no-any-return]

    if family == "resnet":
        config = transformers.ResNetConfig(
            num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
        )
        net, x = transformers.ResNetForImageClassification(config), torch.randn(2, 1, 16, 16)
    else:
        config = transformers.BertConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            vocab_size=50, num_labels=3, max_position_embeddings=16,
        )  # fmt: skip
        net, x = transformers.BertForSequenceClassification(config), torch.randint(0, 50, (2, 8))
    model = (Logits(net) if wrapped else net).eval()
    blocks = auto_blocks(model, x)
    assert len(blocks) >= 4
    y = x
    for block in blocks:
        y = block.eval()(y)
    assert isinstance(y, torch.Tensor), type(y)
    assert torch.allclose(y, net(x).logits, atol=1e-5)


def test_buffers_a_forward_updates_in_place_are_updated_by_its_blocks() -> None:
    """Making in-place operations out of place turned ``self.running.mul_(0.9).add_(m)``
    into dead code: the buffer never changed in any block, checkpoint or export, and a
    buffer used only so dropped out of the blocks altogether."""
    eager, split = stateful((6,), 3), stateful((6,), 3)
    split.load_state_dict(eager.state_dict())
    blocks = auto_blocks(split, torch.zeros(4, 6))
    for _ in range(3):
        x = torch.randn(4, 6)
        y = x
        for block in blocks:
            y = block.train()(y)
        assert torch.allclose(y, eager.train()(x), atol=1e-6)
    running = eager.get_buffer("center.running")
    assert running.abs().sum() > 0 and torch.allclose(split.get_buffer("center.running"), running)
    assert float(split.get_buffer("center.steps")) == 3.0
    held = {name for block in blocks for name, _ in block.named_buffers()}
    assert {"center.running", "center.steps"} <= held, held


def test_a_model_updating_its_buffers_exports_and_checks_with_the_buffers_it_has(
    tmp_path: Path,
) -> None:
    """Its forward changes the buffer on every call: the export and onnxruntime check each
    ran it at another state (the check failed by 0.17), and left the buffer moved."""
    model = build_model("tests.fixtures.user_models:stateful", (6,), 3).full()
    for _ in range(2):
        model.train()(torch.randn(8, 6))
    before = {name: b.clone() for name, b in model.named_buffers()}
    check = export_checked(model, (6,), tmp_path / "stateful.onnx")
    assert check.max_abs_diff < 1e-4, check
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


class _Noise(nn.Module):
    """Noise in training only: a path of its own in each mode (torch.fx keeps one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        return x


class _Halved(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if not self.training else x


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.halved = nn.Linear(16, 16), _Halved()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.halved(self.linear(x)))


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.noise = nn.Linear(8, 16), _Noise()
        self.body, self.head = nn.Sequential(_Block(), _Block()), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.noise(torch.relu(self.stem(x)))))


def test_layers_branching_on_self_training_are_kept_whole_and_follow_their_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A submodule taking another path in training (noise added, a rescale in evaluation)
    made the whole model refused: a traced graph holds one of the two paths. Kept whole, each
    runs its own forward in the mode its block is in; only the innermost such part is."""
    model = _Branching()
    x = torch.randn(5, 8)
    with caplog.at_level("INFO", logger="split_models.autosplit"):
        blocks = auto_blocks(model, x)
    assert "body.0.halved, body.1.halved, noise" in caplog.text
    assert len(blocks) >= 3
    for mode in (False, True):
        model.train(mode)
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        y = x
        for block in blocks:
            y = block.train(mode)(y)
        assert torch.allclose(y, expected, atol=1e-6), f"training={mode}"
    model.eval()
    assert not torch.allclose(model(x), model.train()(x)), "the two modes differ"
