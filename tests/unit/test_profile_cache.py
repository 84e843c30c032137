"""The profile cache: a model is measured once per inputs, host and code; any changed input is
measured again, a user's model by import path is kept under its code and network, and an
unreadable entry is measured again."""

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


def test_a_users_model_is_cached_under_its_code_and_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: list[tuple[str, int | None]]
) -> None:
    """A user's model (always an import path) was measured on every run: 50 s for a
    MobileNetV3 each time. It is kept under its sources and the network it builds."""
    code = tmp_path / "code"
    code.mkdir()
    model_file = code / "my_net.py"
    model_file.write_text(
        "from torch import nn\n\n\ndef net(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, WIDTH), nn.ReLU(),"
        " nn.Linear(WIDTH, num_classes))\n\n\nWIDTH = 16\n"
    )
    monkeypatch.syspath_prepend(str(code))
    users = ModelConfig("my_net:net", (1, 8, 8), 10)
    cache = tmp_path / "cache"
    isolated.profile_in_fresh_process(users, ("linear",), 16, cache=cache)
    isolated.profile_in_fresh_process(users, ("linear",), 16, cache=cache)
    assert len(measured) == 1, "read back from the cache"
    (code / "helpers.py").write_text("SCALE = 2\n")  # a file beside it changed
    isolated.profile_in_fresh_process(users, ("linear",), 16, cache=cache)
    assert len(measured) == 2
    broken = ModelConfig("my_net:missing", (1, 8, 8), 10)  # not built here: the child says
    isolated.profile_in_fresh_process(broken, ("linear",), 16, cache=cache)
    isolated.profile_in_fresh_process(broken, ("linear",), 16, cache=cache)
    assert len(measured) == 4 and len(list(cache.glob("*.json"))) == 2


def test_two_processes_profiling_one_model_at_once_measure_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: list[tuple[str, int | None]]
) -> None:
    """Two simulations of one model started together each measured it (50 s apiece for a
    MobileNetV3, each slowed by the other): the second now waits for the first's profile."""
    import threading
    import time

    slow = isolated._measure

    def measure(*args: object) -> ModelProfile:
        time.sleep(0.5)  # the other caller arrives while this one measures
        return slow(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(isolated, "_measure", measure)
    profiles: list[ModelProfile] = []
    callers = [
        threading.Thread(
            target=lambda: profiles.append(
                isolated.profile_in_fresh_process(MLP, ("linear",), 16, cache=tmp_path)
            )
        )
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert measured == [("mlp", 16)] and len(profiles) == 2
    assert profiles[0].to_dict() == profiles[1].to_dict()
