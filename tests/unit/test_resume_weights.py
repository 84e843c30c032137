"""A resumed run builds only the local heads its checkpoint lacks (building one runs the
model: seconds of a restart in a fresh process)."""

from __future__ import annotations

import numpy as np

from coordinator.service import initial_weights
from split_models.config import ModelConfig


def test_heads_the_checkpoint_holds_are_not_built_again() -> None:
    model = ModelConfig("cnn", (1, 8, 8), 10).build(seed=0)
    fresh = initial_weights(model, "linear", [1, 2], seed=0)
    stored = {k: v + 1 for k, v in fresh.items() if not k.startswith("head2.")}

    again = initial_weights(model, "linear", [1, 2], seed=0, known=stored)

    assert not any(k.startswith("head1.") for k in again)
    heads2 = [k for k in fresh if k.startswith("head2.")]
    assert heads2 and all(np.array_equal(again[k], fresh[k]) for k in heads2)
    blocks = [k for k in fresh if k.startswith("block")]
    assert blocks and all(np.array_equal(again[k], fresh[k]) for k in blocks)
