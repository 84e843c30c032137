"""The exported state dict of a traced model loads strictly into the user's own class."""

from __future__ import annotations

import pytest
import torch

from coordinator.export import state_dict_of
from split_models.zoo import build_model
from tests.fixtures.user_models import with_spare

pytestmark = pytest.mark.unit


def test_layers_forward_never_uses_are_in_it_as_the_run_built_them() -> None:
    """A layer defined but not used was missing: MyNet().load_state_dict(...) failed with
    'Missing key(s)' unless strict=False. A buffer not saved was in it: 'Unexpected key(s)'
    (a Hugging Face BERT's position ids)."""
    model = build_model("tests.fixtures.user_models:with_spare", (6,), 3, seed=7)
    with torch.no_grad():
        for parameter in model.full().parameters():  # as trained
            parameter.add_(1.0)
    state = state_dict_of(model)
    torch.manual_seed(7)
    mine = with_spare((6,), 3)  # the user's class, as the run's seed built it
    assert mine.load_state_dict(state, strict=True)
    torch.manual_seed(7)
    built = with_spare((6,), 3)
    assert torch.equal(mine.spare.weight, built.spare.weight), "nobody trained it"
    assert torch.equal(mine.body.weight, built.body.weight + 1.0), "the trained weights"
