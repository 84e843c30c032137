"""Layers whose forward torch.fx cannot trace (third-party layers, transformers models) are
kept whole, and the model is cut around them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from split_models.autosplit import auto_blocks
from split_models.zoo import build_model

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


@pytest.mark.parametrize("family", ["resnet", "bert"])
def test_models_from_transformers_split_around_the_layers_that_do_not_trace(family: str) -> None:
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
    model = Logits(net).eval()
    blocks = auto_blocks(model, x)
    assert len(blocks) >= 4
    y = x
    for block in blocks:
        y = block.eval()(y)
    assert torch.allclose(y, model(x), atol=1e-5)
