"""A local head that is the model's own back (``training.head_from_back``): where a head can
be, the names the coordinator sends the back's tensors under, and when it applies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from split_models.config import ModelConfig, TrainingConfig
from split_models.mirror import head_mirrors, mirrored_head, with_mirrored_heads
from split_models.zoo import build_model

CNN = ModelConfig("cnn", (1, 8, 8), 10)


def test_the_cnns_linear_head_at_its_last_cut_is_its_classifier_and_no_other_head_is() -> None:
    """The cnn's block 5 is ``Linear(128, 10)``: the linear head at cut 5 computes it given
    its weights; no other cut leaves a back a head can compute, nor does an mlp head."""
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    assert mirrored_head(model, 5, "linear") == {
        "head5.net.1.weight": "block5.0.weight",
        "head5.net.1.bias": "block5.0.bias",
    }
    assert [mirrored_head(model, cut, "linear") for cut in (0, 1, 2, 3, 4, 6)] == [{}] * 6
    assert mirrored_head(model, 5, "mlp") == mirrored_head(model, 5, "supcon") == {}


def test_a_back_of_the_same_shapes_computing_something_else_is_not_mirrored() -> None:
    """resnet8's classifier is a Linear too, but after a global pool where the head pools to
    2x2 (and its blocks hold BatchNorm buffers): shapes alone do not decide, the outputs do."""
    model = build_model("resnet8", (1, 28, 28), 10, seed=0)
    assert not any(mirrored_head(model, cut, "linear") for cut in range(1, model.num_blocks))
    mlp = build_model("mlp", (1, 28, 28), 10, seed=0)
    assert mirrored_head(mlp, mlp.num_blocks - 1, "linear"), "mlp's classifier after a cut"


def test_the_edges_head_tensors_are_the_backs_and_nothing_else_changes() -> None:
    weights = {"block5.0.weight": np.ones((2, 2)), "head5.net.1.weight": np.zeros((2, 2))}
    chosen = {"block0.0.weight": np.full(3, 7.0), "head5.net.1.weight": np.zeros((2, 2))}
    sent = with_mirrored_heads(chosen, weights, {"head5.net.1.weight": "block5.0.weight"})
    assert np.array_equal(sent["head5.net.1.weight"], np.ones((2, 2)))
    assert np.array_equal(sent["block0.0.weight"], chosen["block0.0.weight"])
    assert sent.keys() == chosen.keys()


@pytest.mark.parametrize(
    ("changes", "want"),
    [
        ({}, [5]),
        ({"head_from_back": False}, []),
        ({"mode": "backprop"}, []),  # splitfed edges train with the back's gradient, no head
        ({"local_loss": "mlp"}, []),
    ],
)
def test_the_coordinator_mirrors_only_local_loss_heads_when_asked(
    changes: dict[str, object], want: list[int]
) -> None:
    training = dataclasses.replace(TrainingConfig(rounds=1), **changes)  # type: ignore[arg-type]
    assert sorted(head_mirrors(CNN, training, [2, 5])) == want


def test_a_model_that_cannot_be_probed_keeps_its_own_heads_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: object) -> dict[str, str]:
        raise RuntimeError("forward needs a mask")

    monkeypatch.setattr("split_models.mirror.mirrored_head", broken)
    model = ModelConfig("cnn", (1, 12, 12), 10)  # a model no other test probed (a cache)
    with caplog.at_level("WARNING"):
        assert head_mirrors(model, TrainingConfig(rounds=1), [5]) == {}
    assert "cut 5 keeps a head of its own (probing failed: forward needs a mask)" in caplog.text


def test_probing_leaves_the_global_random_state_as_it_found_it() -> None:
    """A simulation's coordinator shares the process, and torch's RNG, with its clients."""
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert mirrored_head(model, 5, "linear")
    assert torch.equal(torch.rand(3), expected)
