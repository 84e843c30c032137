"""Fixtures the coordinator's integration tests share (a module may define its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from split_models.config import ModelConfig
from split_models.isolated import profile_in_fresh_process
from split_models.profiler import ModelProfile
from storage import open_store
from storage.base import RunStore


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    """The digits cnn (1x8x8 inputs, 10 classes) profiled at batch 16 in a fresh process."""
    return profile_in_fresh_process(ModelConfig("cnn", (1, 8, 8), 10), ("linear",), 16)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    """A SQLite run store in the test's folder."""
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as opened:
        yield opened
