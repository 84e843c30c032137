"""``Segment.train_from``: a step entered at any block of a segment equals the step of the
segment that starts there, leaves the blocks before it alone, and returns the input gradient
that autograd computes for the same loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from split_models import OptimizerConfig, Segment, build_model

pytestmark = pytest.mark.unit

SHAPE = (1, 28, 28)


def _back(start: int) -> Segment:
    model = build_model("cnn", SHAPE, 10, seed=0)
    return Segment.from_model(model, start, model.num_blocks, optimizer=OptimizerConfig("sgd"))


def _batch(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    front = build_model("cnn", SHAPE, 10, seed=2).segment(0, block)
    with torch.no_grad():
        return front(torch.randn(4, *SHAPE)), torch.tensor([0, 3, 5, 9])


def test_entering_at_a_later_block_equals_the_segment_that_starts_there() -> None:
    inputs, labels = _batch(3)
    wide, narrow = _back(1), _back(3)
    before = [p.detach().clone() for p in wide.module[:2].parameters()]

    entered = wide.train_from(3, inputs, labels)
    own = narrow.train_step(inputs, labels)

    assert entered.loss == pytest.approx(own.loss)
    torch.testing.assert_close(entered.output, own.output)
    for trained, reference in zip(
        wide.module[2:].parameters(), narrow.module.parameters(), strict=True
    ):
        torch.testing.assert_close(trained, reference)
    for untouched, original in zip(wide.module[:2].parameters(), before, strict=True):
        torch.testing.assert_close(untouched, original)


def test_the_input_gradient_is_that_of_the_loss() -> None:
    inputs, labels = _batch(2)
    segment, reference = _back(2), _back(2)
    probe = inputs.clone().requires_grad_(True)
    expected = torch.autograd.grad(F.cross_entropy(reference.module(probe), labels), probe)[0]

    result = segment.train_from(2, inputs, labels, input_gradient=True)

    assert result.input_gradient is not None
    torch.testing.assert_close(result.input_gradient, expected)
    assert segment.train_from(2, inputs, labels).input_gradient is None


def test_a_block_outside_the_segment_is_refused() -> None:
    inputs, labels = _batch(1)
    with pytest.raises(ValueError, match="block: a batch enters segment"):
        _back(2).train_from(1, inputs, labels)
