"""Model fingerprints: the same code gives the same digests, a changed function a changed one."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.nn import functional

from split_models import build_model
from split_models.fingerprint import (
    block_digest,
    changed_blocks,
    describe_blocks,
    model_fingerprint,
    parse_fingerprint,
)

pytestmark = pytest.mark.unit


def test_the_same_model_built_twice_has_the_same_digests_whatever_its_weights() -> None:
    first = model_fingerprint(build_model("resnet8", (3, 32, 32), 10, seed=0).blocks)
    again = model_fingerprint(build_model("resnet8", (3, 32, 32), 10, seed=5).blocks)
    assert first == again and len(first) == 5 and len(set(first)) == 5


def test_a_changed_layer_without_weights_changes_its_block_only() -> None:
    blocks = [nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2)]
    changed = [nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2)]
    assert changed_blocks(model_fingerprint(blocks), model_fingerprint(changed)) == [0]


class Relu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.relu(x)


def _gelu_class() -> type[nn.Module]:
    class Relu(nn.Module):  # same name, same repr: another forward
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.gelu(x)

    return Relu


def test_a_user_class_with_another_forward_has_another_digest() -> None:
    assert repr(Relu()) == repr(_gelu_class()())
    assert block_digest(Relu()) != block_digest(_gelu_class()())


def test_a_traced_block_has_its_generated_code_in_its_digest() -> None:
    relu = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    gelu = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    assert block_digest(relu) != block_digest(gelu)


class WithAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = lambda x: x  # shown in repr with its address, new in every process

    def extra_repr(self) -> str:
        return f"act={self.act}"


def test_an_object_address_in_a_repr_does_not_change_the_digest() -> None:
    first, second = WithAFunction(), WithAFunction()
    assert repr(first) != repr(second)
    assert block_digest(first) == block_digest(second)


def test_stored_fingerprints_parse_back_and_changes_are_named() -> None:
    assert parse_fingerprint('{"blocks": ["a", "b"]}') == ["a", "b"]
    assert parse_fingerprint("not json") is None
    assert parse_fingerprint('{"blocks": [1]}') is None and parse_fingerprint("[]") is None
    assert changed_blocks(["a", "b"], ["a", "b", "c"]) == [0, 1, 2]  # another block count
    assert describe_blocks([2]) == "block 2"
    assert describe_blocks(list(range(10)), listed=3) == "blocks 0, 1, 2 and 7 more"
