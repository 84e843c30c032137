"""The model profile is stored with the run: a coordinator that must plan again (a restart,
devices changed) reuses it while the model, batch size and local loss are unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.config import RunConfig
from coordinator.planner import Planner
from split_models.profiler import BlockProfile, ModelProfile
from storage import open_store
from storage.base import RunStore
from wire.flower import TransportGrid
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

SHAPE = (1, 8, 8)


@pytest.fixture
def measured() -> ModelProfile:
    """A profile as the profiler returns one (measuring a real one takes a minute on a loaded
    CI machine; what is tested here is that it is stored, keyed and read back equal)."""
    numbers = [f.name for f in dataclasses.fields(BlockProfile) if f.type == "int"]
    blocks = tuple(
        BlockProfile(
            **{name: 1000 * k + i for i, name in enumerate(numbers)},
            input_shape=(1, 8, 8),
            output_shape=(8, 4, 4),
            saves_input=True,
            saves_output=False,
            summary=f"block{k}",
        )
        for k in range(3)
    )
    return ModelProfile("cnn", SHAPE, 10, blocks, {"linear": blocks[:1] * 3}, label_bytes=8)


@pytest.fixture(params=["sqlite", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}" if request.param == "sqlite" else "memory://"


def run_config(**changes: object) -> RunConfig:
    fields: dict[str, object] = {
        "run_id": "prof-1",
        "model": "cnn",
        "input_shape": list(SHAPE),
        "num_classes": 10,
        "devices": {"edges": ["pi-01"], "gpu_servers": 1},
        "batch_size": 16,
        "rounds": 1,
    }
    return RunConfig.parse(fields | changes)


def planner(
    config: RunConfig, store: RunStore, calls: list[RunConfig], measured: ModelProfile
) -> Planner:
    def profile(asked: RunConfig) -> ModelProfile:
        calls.append(asked)
        return measured

    grid = TransportGrid(InProcessHub().connect("coordinator"))
    return Planner(config, store, grid, "session", profile, min_edges=1)


@pytest.fixture
def stores(url: str) -> Iterator[list[RunStore]]:
    """Two opens of one store, as a coordinator and its restarted successor see it."""
    first = open_store(url)
    second = open_store(url) if url != "memory://" else first
    try:
        yield [first, second]
    finally:
        first.close()
        second.close()


def test_a_restart_reuses_the_stored_profile(
    stores: list[RunStore], measured: ModelProfile
) -> None:
    config, calls = run_config(), list[RunConfig]()
    stores[0].create_run(config.run_id, config.to_dict(), 0)
    first = planner(config, stores[0], calls, measured).profile()

    again = planner(config, stores[1], calls, measured).profile()

    assert len(calls) == 1, "the restarted planner profiled again"
    assert again == first == measured


@pytest.mark.parametrize(
    "change", [{"batch_size": 32}, {"local_loss": "mlp"}, {"input_shape": [1, 12, 12]}]
)
def test_a_profile_of_another_model_or_batch_is_measured_anew(
    stores: list[RunStore], measured: ModelProfile, change: dict[str, object]
) -> None:
    config, calls = run_config(), list[RunConfig]()
    stores[0].create_run(config.run_id, config.to_dict(), 0)
    planner(config, stores[0], calls, measured).profile()

    changed = run_config(**change)
    planner(changed, stores[1], calls, measured).profile()
    planner(changed, stores[1], calls, measured).profile()

    assert [c.to_dict() for c in calls] == [config.to_dict(), changed.to_dict()]


def test_an_unreadable_stored_profile_is_measured_anew(
    stores: list[RunStore], measured: ModelProfile
) -> None:
    config, calls = run_config(), list[RunConfig]()
    stores[0].create_run(config.run_id, config.to_dict(), 0)
    first = planner(config, stores[0], calls, measured)
    first.profile()
    document = stores[0].get_profile(config.run_id) or {}
    stores[0].set_profile(config.run_id, {**document, "profile": {"model": "cnn"}})

    assert planner(config, stores[1], calls, measured).profile() == measured
    assert len(calls) == 2
