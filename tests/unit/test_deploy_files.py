"""The deployment files are consistent with the code: the compose services' commands parse
with the edgesplit CLI, the example run config validates, and the data script writes data the
run config accepts."""

from __future__ import annotations

import runpy
import shlex
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import yaml

from coordinator.config import load_run_config
from edgesplit.cli import build_parser
from split_models import load_dataset

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_compose_commands_parse_with_the_cli() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    roles = {}
    for name, service in compose["services"].items():
        if "image" in service and service["image"].startswith("edgesplit"):
            args = build_parser().parse_args(shlex.split(service["command"]))
            roles[name] = args.command
    assert roles == {
        "coordinator": "coordinator",
        "gpu-a": "gpu-server",
        "pi-01": "edge",
        "pi-02": "edge",
        "pi-03": "edge",
    }


def _no_password_in(url: str) -> bool:
    return urlparse(url).password is None


def test_no_shipped_command_line_holds_a_password() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        if "image" in service and service["image"].startswith("edgesplit"):
            args = build_parser().parse_args(shlex.split(service["command"]))
            assert _no_password_in(args.broker), service["command"]
            assert _no_password_in(getattr(args, "db", "")), service["command"]
        for key, value in (service.get("environment") or {}).items():  # from .env only
            assert "PASSWORD" not in key or str(value).startswith("${"), (key, value)
    unit = (DEPLOY / "systemd" / "edgesplit-edge.service").read_text()
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / "edgesplit-edge.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert "EDGESPLIT_BROKER_PASSWORD" not in env  # only the file's path, not the password
    assert env["EDGESPLIT_BROKER_PASSWORD_FILE"].startswith("/")
    command = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    for name, value in env.items():
        command = command.replace(f"${{{name}}}", value)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.command == "edge" and _no_password_in(args.broker)
    assert urlparse(args.broker).username == env["DEVICE_ID"]


def test_example_run_configs_validate() -> None:
    config = load_run_config(DEPLOY / "compose" / "run.yaml")
    assert config.devices.edges == ("pi-01", "pi-02", "pi-03")


def test_make_data_writes_what_the_run_expects(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    script = runpy.run_path(str(DEPLOY / "compose" / "make_data.py"))
    script["main"](["--source", "digits", "--out", str(tmp_path)])
    config = load_run_config(DEPLOY / "compose" / "run.yaml")
    for name in ("pi-01", "pi-02", "pi-03", "test"):
        data = load_dataset(f"npz:{tmp_path / f'{name}.npz'}")
        assert data.x.shape[1:] == config.model.input_shape
        assert set(np.unique(data.y)) <= set(range(config.model.num_classes))
