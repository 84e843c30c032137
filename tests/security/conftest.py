"""The production broker for the security tests: the shipped deploy/mosquitto configuration
(TLS, no anonymous access, an account per device made with add-device.sh, the shipped ACL and
the client-id plugin), on a free loopback port with a throwaway CA."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.certs import certificates
from wire.broker import Broker, free_port
from wire.mqtt import MqttConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
# The coordinator's and the GPU servers' accounts, three edges and one more device account
# that the tests compromise.
ACCOUNTS = ("coordinator", "gpu", "pi-01", "pi-02", "pi-03", "mallory")


def _missing(what: str) -> None:
    """Skip where a tool is absent; under CI (``CI`` set) .ci/run installs it, so fail."""
    if os.environ.get("CI"):
        pytest.fail(what)
    pytest.skip(what)


@pytest.fixture(scope="session")
def production_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Certificates, the plugin and one password per account, made once per test session."""
    for tool in ("openssl", "mosquitto_passwd", os.environ.get("CC", "cc")):
        if shutil.which(tool) is None:
            _missing(f"{tool} is not installed (scripts/services.sh installs it)")
    directory = tmp_path_factory.mktemp("production-broker")
    certificates(directory, "server")
    plugin = directory / "clientid_bind.so"
    built = subprocess.run(
        ["bash", str(DEPLOY / "build-plugin.sh"), str(plugin)], capture_output=True, text=True
    )
    if built.returncode != 0:
        _missing(f"cannot build the broker plugin: {built.stderr.strip()[-400:]}")
    passwords = {account: secrets.token_urlsafe(12) for account in ACCOUNTS}
    password_file = directory / "passwords"
    for account, password in passwords.items():
        subprocess.run(
            ["bash", str(DEPLOY / "add-device.sh"), str(password_file), account],
            input=f"{password}\n",
            text=True,
            check=True,
            capture_output=True,
        )
    return {"dir": directory, "plugin": plugin, "passwords": passwords}


def production_config(files: dict[str, Any], port: int, persistence: Path) -> str:
    """deploy/mosquitto/mosquitto.conf with its paths pointed at the test's files."""
    directory: Path = files["dir"]
    text = (DEPLOY / "mosquitto.conf").read_text()
    for old, new in {
        "listener 8883": f"listener {port} 127.0.0.1",
        "/mosquitto/config/passwords": str(directory / "passwords"),
        "/mosquitto/config/acl": str(DEPLOY / "acl"),
        "/mosquitto/plugins/clientid_bind.so": str(files["plugin"]),
        "/mosquitto/certs/ca.crt": str(directory / "server-ca.crt"),
        "/mosquitto/certs/server.crt": str(directory / "server.crt"),
        "/mosquitto/certs/server.key": str(directory / "server.key"),
        "/mosquitto/data/": f"{persistence}/",
    }.items():
        if old not in text:
            raise AssertionError(f"deploy/mosquitto/mosquitto.conf no longer has {old!r}")
        text = text.replace(old, new)
    if os.geteuid() == 0:
        text += "user root\n"  # read the test's files instead of switching to 'mosquitto'
    return text


@dataclass
class ProductionBroker:
    """A running production broker and the accounts on it."""

    broker: Broker
    port: int
    ca_file: Path
    passwords: dict[str, str]

    def url(self, account: str, *, with_password: bool = False) -> str:
        """``mqtts://ACCOUNT@127.0.0.1:PORT?ca=...``; the password goes in the URL only when
        asked (agents read it from EDGESPLIT_BROKER_PASSWORD(_FILE) otherwise)."""
        secret = f":{self.passwords[account]}" if with_password else ""
        return f"mqtts://{account}{secret}@127.0.0.1:{self.port}?ca={self.ca_file}"

    def config(self, account: str, **overrides: Any) -> MqttConfig:
        config = MqttConfig.from_url(self.url(account), connect_timeout=5.0)
        return replace(config, password=self.passwords[account], **overrides)


@pytest.fixture
def production_broker(production_files: dict[str, Any]) -> Iterator[ProductionBroker]:
    port = free_port()
    broker = Broker(port=port, config="")  # its folder holds the persistence
    broker.config_path.write_text(production_config(production_files, port, broker.directory))
    with broker:
        yield ProductionBroker(
            broker, port, production_files["dir"] / "server-ca.crt", production_files["passwords"]
        )
