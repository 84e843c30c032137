"""The profile cache: a model is measured once per inputs, host and code; any changed input is
measured again, a user's model by import path never comes from the cache, and an unreadable
entry is measured again."""

from __future__ import annotations

from pathlib import Path

import pytest

from split_models import isolated
from split_models.config import ModelConfig
from split_models.profiler import BlockProfile, ModelProfile

pytestmark = pytest.mark.unit

MLP = ModelConfig("mlp", (1, 8, 8), 10)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """The profiles really measured (in-process here, instead of a child process)."""
    calls: list[tuple[str, int | None]] = []

    def measure(
        model: ModelConfig, losses: tuple[str, ...], batch: int | None, _timeout: float
    ) -> ModelProfile:
        calls.append((model.name, batch))
        block = BlockProfile(
            4096, 0, 4096, (1, 8, 8), (64,), 256, 256, 256, 0, True, False, 256, 8192
        )
        return ModelProfile(model.name, model.input_shape, model.num_classes, (block,) * 2)

    monkeypatch.setattr(isolated, "_measure", measure)
    return calls


def test_a_cached_profile_is_measured_once_and_read_back_equal(
    tmp_path: Path, measured: list[tuple[str, int | None]]
) -> None:
    first = isolated.profile_in_fresh_process(MLP, ("linear",), 16, cache=tmp_path)
    again = isolated.profile_in_fresh_process(MLP, ("linear",), 16, cache=tmp_path)
    assert measured == [("mlp", 16)]
    assert again.to_dict() == first.to_dict()
    isolated.profile_in_fresh_process(MLP, ("linear",), 32, cache=tmp_path)  # another batch
    isolated.profile_in_fresh_process(MLP, ("mlp",), 16, cache=tmp_path)  # another head
    isolated.profile_in_fresh_process(MLP, ("linear",), 16)  # no cache: always measured
    assert measured == [("mlp", 16), ("mlp", 32), ("mlp", 16), ("mlp", 16)]


def test_an_unreadable_entry_is_measured_again(
    tmp_path: Path, measured: list[tuple[str, int | None]]
) -> None:
    isolated.profile_in_fresh_process(MLP, ("linear",), 16, cache=tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text('{"blocks": [')
    isolated.profile_in_fresh_process(MLP, ("linear",), 16, cache=tmp_path)
    assert len(measured) == 2


def test_a_model_given_by_import_path_is_never_cached(
    tmp_path: Path, measured: list[tuple[str, int | None]]
) -> None:
    users = ModelConfig("tests.fixtures.user_models:small_cnn", (1, 8, 8), 10)
    isolated.profile_in_fresh_process(users, ("linear",), 16, cache=tmp_path)
    isolated.profile_in_fresh_process(users, ("linear",), 16, cache=tmp_path)
    assert len(measured) == 2 and not list(tmp_path.iterdir())
