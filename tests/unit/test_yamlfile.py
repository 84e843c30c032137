"""Config files refuse a key given twice (PyYAML kept the last: ``rounds: 1`` then
``rounds: 3`` ran 3 rounds, against "every key is validated")."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coordinator.config import load_run_config
from simulation.config import load_sim_config
from split_models.devices import load_devices
from split_models.errors import ConfigError
from split_models.yamlfile import load_yaml

pytestmark = pytest.mark.unit


def test_a_key_given_twice_is_refused_at_any_depth() -> None:
    assert load_yaml("a: 1\nb: {c: 2, d: [1, {c: 3}]}\n") == {
        "a": 1,
        "b": {"c": 2, "d": [1, {"c": 3}]},
    }
    with pytest.raises(yaml.YAMLError, match=r"key 'rounds' given twice \(line 3\)"):
        load_yaml("rounds: 1\nclients: 2\nrounds: 3\n")
    with pytest.raises(yaml.YAMLError, match="key 'lr' given twice"):
        load_yaml("optimizer:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(yaml.YAMLError):
        load_yaml("!!python/object/apply:os.system ['true']\n")  # still safe


@pytest.mark.parametrize("loader", [load_run_config, load_devices])
def test_every_config_file_refuses_a_repeated_key(tmp_path: Path, loader: object) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 1\nrounds: 3\n")
    with pytest.raises(ConfigError, match="is not valid YAML: key 'rounds' given twice"):
        loader(path)  # type: ignore[operator]
    with pytest.raises(ConfigError, match="is not valid YAML: key 'rounds' given twice"):
        load_sim_config(path, {})
