"""The deployment files are consistent with the code: the compose services' and systemd units'
commands parse with the edgesplit CLI, the units are hardened (systemd's own score), the
install script stages what it says, compose waits for healthy services and restarts failed
ones, the example run config validates, and the data script writes data the run accepts."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import shutil
import stat
import subprocess
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


UNITS = ("edge", "gpu-server", "coordinator")


def _unit_command(role: str) -> tuple[argparse.Namespace, dict[str, str]]:
    """The unit's ExecStart parsed by the CLI, with the example settings filled in."""
    unit = (DEPLOY / "systemd" / f"edgesplit-{role}.service").read_text()
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / f"edgesplit-{role}.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    command = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    for name, value in env.items():
        command = command.replace(f"${{{name}}}", value)
    if "${" in command:
        raise AssertionError(f"{role}: a setting the example does not define: {command}")
    return build_parser().parse_args(shlex.split(command)[1:]), env


@pytest.mark.parametrize("role", UNITS)
def test_systemd_units_run_their_role_without_a_password_on_the_command_line(role: str) -> None:
    args, env = _unit_command(role)
    assert args.command == role
    assert "EDGESPLIT_BROKER_PASSWORD" not in env  # only the file's path, not the password
    assert env["EDGESPLIT_BROKER_PASSWORD_FILE"].startswith("/")
    assert _no_password_in(args.broker)
    assert _no_password_in(getattr(args, "db", "") or "")
    if role == "edge":
        assert urlparse(args.broker).username == env["DEVICE_ID"]


def _exposure(unit: Path) -> float:
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        pytest.skip(f"systemd-analyze cannot score a unit file offline here: {done.stderr[:200]}")
    return float(found.group(1))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize("role", UNITS)
def test_systemd_units_are_hardened(role: str) -> None:
    # systemd's own score: 0 is locked down, 10 fully exposed; "OK" is under 4.0
    assert _exposure(DEPLOY / "systemd" / f"edgesplit-{role}.service") < 4.0


def test_install_script_stages_the_user_venv_settings_and_unit(tmp_path: Path) -> None:
    environment = {**os.environ, "DESTDIR": str(tmp_path), "EDGESPLIT_SKIP_PIP": "1"}
    script = DEPLOY / "systemd" / "install.sh"
    done = subprocess.run(
        ["bash", str(script), "gpu-server"], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    settings = tmp_path / "etc" / "edgesplit" / "gpu-server.env"
    unit = tmp_path / "etc" / "systemd" / "system" / "edgesplit-gpu-server.service"
    assert (tmp_path / "opt" / "edgesplit" / "venv" / "bin" / "python").exists()
    assert stat.S_IMODE(settings.stat().st_mode) == 0o640
    assert stat.S_IMODE(settings.parent.stat().st_mode) == 0o750
    assert unit.read_text() == (DEPLOY / "systemd" / "edgesplit-gpu-server.service").read_text()
    assert "systemctl enable --now edgesplit-gpu-server" in done.stdout
    settings.write_text("DEVICE_ID=mine\n")  # edited settings survive a reinstall
    again = subprocess.run(["bash", str(script), "gpu-server"], env=environment, check=False)
    assert again.returncode == 0 and settings.read_text() == "DEVICE_ID=mine\n"
    wrong = subprocess.run(["bash", str(script), "server"], env=environment, capture_output=True)
    assert wrong.returncode == 2


def test_compose_starts_on_healthy_services_and_restarts_what_failed() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"test", "interval", "retries"} <= set(services["broker"]["healthcheck"])
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    healthy = {"condition": "service_healthy"}
    assert services["coordinator"]["depends_on"] == {"broker": healthy, "postgres": healthy}
    for name, service in services.items():
        assert service.get("restart", "no") != "no", name
        if name not in ("broker", "postgres"):
            assert service["depends_on"]["broker"] == healthy, name
    # the coordinator stays down after exit 0 (the run is done), agents come back always
    assert services["coordinator"]["restart"].startswith("on-failure")
    assert services["pi-01"]["restart"] == "unless-stopped"
    assert any(v.endswith(":/mosquitto/data") for v in services["broker"]["volumes"])


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
