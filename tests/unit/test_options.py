"""The torch-free names (``split_models.options``) agree with what the torch modules build."""

from __future__ import annotations

import pytest

from split_models import options
from split_models.heads import LocalHead
from split_models.zoo import INPUT_DTYPES, build_model

pytestmark = pytest.mark.unit


def test_the_input_dtype_names_are_the_zoos_and_the_integer_ones_are_integer() -> None:
    assert tuple(INPUT_DTYPES) == options.INPUT_DTYPE_NAMES
    for name, dtype in INPUT_DTYPES.items():
        assert (name in options._INTEGER_DTYPES) == (not dtype.is_floating_point), name


def test_every_named_local_loss_and_zoo_model_builds() -> None:
    for kind in options.LOCAL_LOSSES:
        LocalHead(kind, (4, 8, 8), 10)
    for name in options.ZOO_NAMES:
        assert build_model(name, (3, 8, 8), 10, seed=0).num_blocks >= 2, name
