"""A run notices when its model's code changed under it: a resume and an export with a model
that computes something else (same weights, another activation) are refused by name, and go
ahead, recorded, when the user says so."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.config import RunConfig
from coordinator.export import export_run
from coordinator.resumption import create_or_check, model_code, stored_code
from split_models import Segment
from split_models.errors import ConfigError
from split_models.weights import segment_state
from storage import RunStore, open_store

pytestmark = pytest.mark.integration

_MODULE = """
from torch import nn
from torch.nn import functional


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        x = functional.ACTIVATION(self.conv(x))
        return self.fc(x.flatten(1))


def build(num_classes):
    return Net(num_classes)
"""


@pytest.fixture
def user_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A user's model module, importable as ``usernet_code``; rewrite it to change the model."""
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "usernet_code.py"
    path.write_text(_MODULE.replace("ACTIVATION", "relu"))
    yield path
    sys.modules.pop("usernet_code", None)


def _rewrite(path: Path, activation: str) -> None:
    """An edit seconds later: a cached .pyc of the same size and second would hide it."""
    modified = path.stat().st_mtime + 10
    path.write_text(_MODULE.replace("ACTIVATION", activation))
    os.utime(path, (modified, modified))
    sys.modules.pop("usernet_code", None)
    importlib.invalidate_caches()


def _config() -> RunConfig:
    return RunConfig.parse(
        {
            "run_id": "code-1",
            "model": "usernet_code:build",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
            "devices": {"edges": 2},
            "rounds": 2,
        }
    )


def _commit_round(store: RunStore, config: RunConfig) -> None:
    model = config.model.build(seed=0)
    store.open_round(config.run_id, 1, ["pi-01"])
    whole = segment_state(Segment.from_model(model, 0, model.num_blocks))
    store.commit_round(config.run_id, 1, {"all": whole})


def test_a_changed_model_is_refused_on_resume_and_export_unless_allowed(
    user_model: Path, tmp_path: Path
) -> None:
    config = _config()
    with open_store(str(tmp_path / "runs.db")) as store:
        create_or_check(store, config, allow_config_change=False)
        _commit_round(store, config)
        trained = stored_code(store, config.run_id)
        assert trained == model_code(config)

        _rewrite(user_model, "gelu")  # the same weights, another function
        with pytest.raises(ConfigError, match=r"other model code: .*changed in block.*--allow"):
            create_or_check(store, config, allow_config_change=False)
        with pytest.raises(ConfigError, match=r"round 1 .* other model code.*--allow-model-change"):
            export_run(store, config.run_id, tmp_path / "onnx")
        assert not (tmp_path / "onnx").exists()  # refused before any file
        exported = export_run(store, config.run_id, tmp_path / "onnx", allow_model_change=True)
        assert exported and all(result.ok for result in exported)

        create_or_check(store, config, allow_config_change=True)
        assert stored_code(store, config.run_id) == model_code(config) != trained
        kinds = [e.kind for e in store.events(config.run_id)]
        assert kinds.count("model-code") == 2 and "config-changed" in kinds

        _rewrite(user_model, "relu")  # the code round 1 was trained with: exported as it was
        assert all(r.ok for r in export_run(store, config.run_id, tmp_path / "again"))


def test_a_model_that_does_not_build_leaves_no_run_behind(user_model: Path, tmp_path: Path) -> None:
    """The run was created before the model was built: each failed start left a run
    'created' for good, listed by status and making export ask which run."""
    from split_models.errors import ModelError

    user_model.write_text(user_model.read_text().replace("return self.fc(", "return x, self.fc("))
    with open_store(str(tmp_path / "runs.db")) as store:
        with pytest.raises(ModelError, match="must return one tensor"):
            create_or_check(store, _config(), allow_config_change=False)
        assert store.list_runs() == []
