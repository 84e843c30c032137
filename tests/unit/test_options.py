"""The torch-free names (``split_models.options``) agree with what the torch modules build."""

from __future__ import annotations

import logging
from pathlib import Path

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


def test_momentum_written_for_an_optimizer_without_it_is_named() -> None:
    adam = options.OptimizerConfig("adam", 0.001)
    (line,) = options.unused_optimizer_keys({"name": "adam", "momentum": 0.5}, adam)
    assert "momentum 0.5" in line and "'adam'" in line and "sgd-momentum" in line
    sgd_m = options.OptimizerConfig("sgd-momentum", 0.01)
    assert options.unused_optimizer_keys({"momentum": 0.5}, sgd_m) == []
    assert options.unused_optimizer_keys({"name": "adam"}, adam) == []  # not written
    assert options.unused_optimizer_keys(None, adam) == []


def test_a_simulation_config_file_warns_of_unused_momentum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from simulation.config import load_sim_config

    path = tmp_path / "SIM.yaml"
    path.write_text("optimizer: {name: sgd, lr: 0.05, momentum: 0.8}\n")
    with caplog.at_level(logging.WARNING):
        config = load_sim_config(path, {})
    assert config.training.optimizer.name == "sgd"
    assert "momentum 0.8 has no effect with optimizer 'sgd'" in caplog.text


def test_adamw_and_nesterov_build_torchs_own() -> None:
    import torch

    from split_models.config import parse_config

    weights = [torch.nn.Parameter(torch.zeros(3))]
    adamw = parse_config(options.OptimizerConfig, {"name": "adamw", "weight_decay": 0.01}, "o")
    assert type(adamw.build(weights)) is torch.optim.AdamW
    assert adamw.build(weights).param_groups[0]["weight_decay"] == 0.01
    assert adamw.head_scale() == 1.0  # as Adam's: its steps are not lr * g
    nesterov = parse_config(options.OptimizerConfig, {"nesterov": True}, "o")
    group = nesterov.build(weights).param_groups[0]
    assert group["nesterov"] is True and group["momentum"] == 0.9
    assert options.OptimizerConfig().build(weights).param_groups[0]["nesterov"] is False


@pytest.mark.parametrize(
    "section",
    [
        {"name": "adam", "nesterov": True},
        {"name": "sgd", "nesterov": True},
        {"momentum": 0.0, "nesterov": True},
        {"nesterov": "yes please"},
    ],
)
def test_nesterov_is_refused_where_torch_has_no_such_step(section: dict[str, object]) -> None:
    from split_models.config import parse_config
    from split_models.errors import ConfigError

    with pytest.raises(ConfigError, match="nesterov"):
        parse_config(options.OptimizerConfig, section, "optimizer")
