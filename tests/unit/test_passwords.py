"""Where the CLI finds the broker's and the database's passwords (edgesplit.passwords): a file
named by a flag, then the environment; never the command line, with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgesplit.passwords import broker_password, db_password
from split_models.errors import ConfigError
from wire.mqtt import MqttConfig

pytestmark = pytest.mark.unit

BROKER = "mqtts://pi-01@broker:8883?ca=ca.crt"
DB = "postgresql+psycopg://edgesplit@db:5432/runs"


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_flag_file_wins_over_the_environment_which_wins_over_its_file(tmp_path: Path) -> None:
    flag = _file(tmp_path, "flag", "from-flag\nsecond line ignored\n")
    named = _file(tmp_path, "named", "from-env-file\n")
    environ = {"EDGESPLIT_BROKER_PASSWORD": "from-env", "EDGESPLIT_BROKER_PASSWORD_FILE": named}

    assert broker_password(BROKER, flag, environ) == "from-flag"
    assert broker_password(BROKER, None, environ) == "from-env"
    assert broker_password(BROKER, None, {"EDGESPLIT_BROKER_PASSWORD_FILE": named}) == (
        "from-env-file"
    )
    assert broker_password(BROKER, None, {}) is None
    db_environ = {"EDGESPLIT_DB_PASSWORD": "db-env", "EDGESPLIT_BROKER_PASSWORD": "other"}
    assert db_password(DB, None, db_environ) == "db-env"
    assert db_password(DB, _file(tmp_path, "db", "db-flag"), db_environ) == "db-flag"


def test_urls_that_take_no_password_from_elsewhere_get_none(tmp_path: Path) -> None:
    environ = {"EDGESPLIT_BROKER_PASSWORD": "env", "EDGESPLIT_DB_PASSWORD": "env"}

    assert broker_password("mqtts://pi-01:inline@broker:8883", None, environ) is None
    assert broker_password("mqtt://broker:1883", None, environ) is None  # no account
    assert broker_password("embedded", None, environ) is None
    assert db_password("runs.db", None, environ) is None
    assert db_password("sqlite:///runs.db", None, environ) is None
    assert db_password("postgresql+psycopg://u:inline@db/runs", None, environ) is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: broker_password(BROKER, f + ".missing", {}), "cannot read .*missing"),
        (lambda f: db_password(DB, None, {"EDGESPLIT_DB_PASSWORD_FILE": f + "x"}), "cannot read"),
        (lambda f: broker_password("mqtts://pi-01:pw@b:8883", f, {}), "holds a password too"),
        (lambda f: broker_password("mqtt://b:1883", f, {}), "names no account"),
        (lambda f: broker_password("none", f, {}), "--broker none takes no password"),
        (lambda f: db_password("runs.db", f, {}), "SQLite store takes no password"),
        (lambda f: db_password("postgresql+psycopg:/u:pw@db/x", None, {}), "lacks '://'"),
    ],
)
def test_misuse_is_refused_in_one_line(tmp_path: Path, call: object, message: str) -> None:
    secret = _file(tmp_path, "secret", "s3cret\n")

    with pytest.raises(ConfigError, match=message) as error:
        call(secret)  # type: ignore[operator]

    assert "\n" not in str(error.value) and "s3cret" not in str(error.value)


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    empty = _file(tmp_path, "empty", "\n")

    with pytest.raises(ConfigError, match="is empty; put the password on its first line"):
        broker_password(BROKER, empty, {})
    with pytest.raises(ConfigError, match=r"EDGESPLIT_DB_PASSWORD_FILE: .* is empty"):
        db_password(DB, None, {"EDGESPLIT_DB_PASSWORD_FILE": empty})


def test_the_broker_config_takes_the_password_only_for_a_url_without_one() -> None:
    assert MqttConfig.from_url(BROKER, "given").password == "given"
    assert MqttConfig.from_url("mqtts://pi-01:inline@b:8883", "given").password == "inline"
    assert MqttConfig.from_url("mqtt://b:1883", "given").password is None  # no account
    with pytest.raises(ValueError) as error:
        MqttConfig.from_url("mqtt://pi-01:s3cret@b:notaport")
    assert "s3cret" not in str(error.value) and "pi-01:***@b:notaport" in str(error.value)


@pytest.mark.parametrize(
    "url", ["mqtt:/127.0.0.1:18931", "mqtt:127.0.0.1:18931", "mqtts://u@", "mqtt://:1883"]
)
def test_a_broker_url_without_a_host_is_refused_not_read_as_localhost(url: str) -> None:
    from wire.mqtt_config import MqttConfig

    with pytest.raises(ValueError, match="expected mqtt://host:port"):
        MqttConfig.from_url(url)  # these were 127.0.0.1:1883, another broker than meant


def test_the_coordinator_names_a_new_sqlite_file_as_new(tmp_path: Path) -> None:
    from coordinator.commands import _store_shown

    (tmp_path / "old.db").write_bytes(b"")
    assert _store_shown(str(tmp_path / "old.db")).endswith("old.db")
    assert _store_shown(str(tmp_path / "triala")).endswith("triala (new: no such file before)")
    assert _store_shown("memory").startswith("memory (nothing is kept")  # no "SQLite file"
    assert _store_shown("postgresql+psycopg://u:secret@db/runs") == (
        "postgresql+psycopg://u:***@db/runs"
    )
