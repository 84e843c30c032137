"""Cuts that carry side tensors: hidden states with the attention mask computed from the ids.

The mask depends on no weight, so it may cross a cut beside the activation; a residual (two
tensors that both depend on weights) still may not. What crosses travels as named tensors
(``x``, ``x.1``), each checked for dtype and shape by the receiving stage; local heads read the
activation; exported segments have one output per tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_server.stage import BackStage
from split_models.activations import activation_arrays, primary, side
from split_models.autosplit import auto_blocks
from split_models.config import ModelConfig
from split_models.isolated import profile_in_fresh_process
from split_models.onnx_export import check_onnx, export_onnx
from split_models.segment import Segment
from split_models.zoo import ModelOptions, build_model
from tests.fixtures import gallery
from wire.codec import Envelope
from wire.errors import WireError

pytestmark = pytest.mark.unit

OPTIONS = ModelOptions("int64", (0, gallery.VOCAB))
NAME = "tests.fixtures.gallery:masked_transformer"


def _model() -> object:
    return build_model(NAME, (12,), 10, seed=0, options=OPTIONS)


def _ids(batch: int = 4) -> torch.Tensor:
    ids = torch.randint(1, gallery.VOCAB, (batch, 12), generator=torch.Generator().manual_seed(3))
    ids[:, 8:] = gallery.PAD  # padded tails: the mask matters
    return ids


def test_the_mask_crosses_the_cuts_between_encoder_layers_and_composition_is_exact() -> None:
    torch.manual_seed(0)
    module = gallery.masked_transformer((12,), 10)
    ids = _ids()
    blocks = auto_blocks(module, ids)
    value: object = ids
    crossing = []
    for block in blocks:
        value = block(value)
        crossing.append(len(side(value)))  # type: ignore[arg-type]
    assert crossing[1:3] == [1, 1], crossing  # hidden states + mask between the layers
    torch.testing.assert_close(value, module(ids), rtol=1e-5, atol=1e-5)
    # gradients through the composed blocks equal the module's
    module.zero_grad()
    module(ids).square().mean().backward()  # type: ignore[no-untyped-call]
    expected = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    torch.nn.Sequential(*blocks)(ids).square().mean().backward()  # type: ignore[no-untyped-call]
    for name, parameter in module.named_parameters():
        if name in expected:
            torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-5, atol=1e-5)


def test_a_residual_is_still_never_cut() -> None:
    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.c(h + self.b(torch.relu(h)))  # type: ignore[no-any-return]

    blocks = auto_blocks(Residual(), torch.zeros(2, 8))
    # a | relu, b and the add (the residual whole) | c: h and b's output, both depending on
    # weights, never cross a cut together
    assert len(blocks) == 3
    value = torch.zeros(2, 8)
    for block in blocks:
        value = block(value)
        assert isinstance(value, torch.Tensor)


def test_a_front_trains_on_its_head_and_the_back_takes_the_named_tensors() -> None:
    model = _model()
    cut = 3  # after the first encoder layer: hidden states and mask cross
    front = Segment.from_model(model, 0, cut)  # type: ignore[arg-type]
    assert front.side_outputs == 1
    labels = torch.randint(0, 10, (4,))
    step = front.train_step(_ids(), labels)
    arrays = activation_arrays(step.output)
    assert set(arrays) == {"x", "x.1"} and arrays["x.1"].dtype == np.bool_
    stage = BackStage(model, cut, model.num_blocks)  # type: ignore[arg-type]
    envelope = Envelope(
        "activations", "r", "pi-01", 0, 1, {"cut": cut}, {**arrays, "y": labels.numpy()}
    )
    result, _ = stage.train(envelope)
    assert np.isfinite(result.loss)
    # each tensor is checked on its own: a float mask, a missing mask, a mask of other rows
    bad = {**arrays, "x.1": arrays["x.1"].astype(np.float32), "y": labels.numpy()}
    with pytest.raises(WireError, match=r"x\.1"):
        stage.validate(Envelope("activations", "r", "pi-01", 1, 1, {"cut": cut}, bad))
    with pytest.raises(WireError, match=r"x\.1"):
        stage.validate(
            Envelope(
                "activations",
                "r",
                "pi-01",
                2,
                1,
                {"cut": cut},
                {"x": arrays["x"], "y": labels.numpy()},
            )
        )
    short = {**arrays, "x.1": arrays["x.1"][:2], "y": labels.numpy()}
    with pytest.raises(WireError, match="rows"):
        stage.validate(Envelope("activations", "r", "pi-01", 3, 1, {"cut": cut}, short))


def test_backprop_mode_returns_the_gradient_of_the_activation_only() -> None:
    model = _model()
    cut = 3
    front = Segment.from_model(model, 0, cut, local_loss="linear")  # type: ignore[arg-type]
    output = front.forward_for_backprop(_ids())
    back = Segment.from_model(model, cut, model.num_blocks)  # type: ignore[arg-type]
    step = back.train_from(cut, output, torch.randint(0, 10, (4,)), input_gradient=True)
    assert step.input_gradient is not None
    assert step.input_gradient.shape == primary(output).shape
    before = [p.detach().clone() for p in front.module.parameters()]
    front.backward_from(output, step.input_gradient)
    assert any(
        not torch.equal(a, p) for a, p in zip(before, front.module.parameters(), strict=True)
    )


def test_a_segment_ending_at_a_multi_tensor_cut_exports_one_output_per_tensor(
    tmp_path: Path,
) -> None:
    model = _model()
    front = Segment.from_model(model, 0, 3)  # type: ignore[arg-type]
    path = export_onnx(front.module, (12,), tmp_path / "front.onnx", (0, gallery.VOCAB))
    check = check_onnx(path, front.module, (12,), input_range=(0, gallery.VOCAB))
    assert check.max_abs_diff < 1e-4


def test_the_profile_counts_the_mask_in_what_crosses_each_cut() -> None:
    spec = ModelConfig(NAME, (12,), 10, "int64", (0, gallery.VOCAB))
    profile = profile_in_fresh_process(spec, ("linear",), 8)
    hidden = 4 * 12 * 32
    assert profile.blocks[1].input_bytes == hidden + 12  # hidden states and the bool mask
    assert profile.blocks[2].output_bytes == hidden + 12
    assert all(b.flops > 0 for b in profile.blocks)
