"""The broker's and the database's passwords, read once by the CLI from a file or the
environment, so that none is on a command line (any local user can read every process's argv).

A password is looked for only when its URL names an account but holds no password: first the
file given by the flag (``--broker-password-file``, ``--db-password-file``), then
``EDGESPLIT_BROKER_PASSWORD`` / ``EDGESPLIT_DB_PASSWORD``, then the file named by
``EDGESPLIT_BROKER_PASSWORD_FILE`` / ``EDGESPLIT_DB_PASSWORD_FILE``. A file's first line is the
password.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from urllib.parse import urlparse

from split_models.errors import ConfigError

__all__ = [
    "BROKER_PASSWORD_ENV",
    "BROKER_PASSWORD_FILE_ENV",
    "DB_PASSWORD_ENV",
    "DB_PASSWORD_FILE_ENV",
    "broker_password",
    "db_password",
    "read_password_file",
    "read_passwords",
]

BROKER_PASSWORD_ENV = "EDGESPLIT_BROKER_PASSWORD"
BROKER_PASSWORD_FILE_ENV = "EDGESPLIT_BROKER_PASSWORD_FILE"
DB_PASSWORD_ENV = "EDGESPLIT_DB_PASSWORD"
DB_PASSWORD_FILE_ENV = "EDGESPLIT_DB_PASSWORD_FILE"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def read_password_file(path: str, source: str) -> str:
    """The first line of ``path``; a one-line ``ConfigError`` naming ``source`` (the flag or
    variable that named the file) when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as handle:
            password = handle.readline().rstrip("\r\n")
    except OSError as error:
        raise ConfigError(
            f"{source}: cannot read {path}: {error.strerror}; give a file this user can read"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: {path} is not UTF-8 text") from None
    if not password:
        raise ConfigError(f"{source}: {path} is empty; put the password on its first line")
    return password


def _wanted(url: str, flag: str, password_file: str | None, account_hint: str) -> bool:
    """Whether ``url`` (an account, no password) takes a password from elsewhere; a file given
    for a URL that cannot take one is an error."""
    parsed = urlparse(url)
    if parsed.password is not None:
        if password_file is not None:
            raise ConfigError(
                f"{flag}: the URL holds a password too; take it out of the URL (it shows in "
                "the process list)"
            )
        return False
    if not parsed.username:
        if password_file is not None:
            raise ConfigError(f"{flag}: the URL names no account; use {account_hint}")
        return False
    return True


def _from_sources(
    flag: str, password_file: str | None, env: str, file_env: str, environ: Mapping[str, str]
) -> str | None:
    if password_file is not None:
        return read_password_file(password_file, flag)
    if environ.get(env):
        return environ[env]
    if environ.get(file_env):
        return read_password_file(environ[file_env], file_env)
    return None


def broker_password(url: str, password_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The password for broker ``url`` (``--broker-password-file``, then the environment), or
    None when the URL needs none from elsewhere (no account, or its own password)."""
    flag = "--broker-password-file"
    if urlparse(url).scheme not in ("mqtt", "mqtts"):  # a bad URL is refused when parsed
        if password_file is not None and url in ("none", "embedded"):  # simulate's own
            raise ConfigError(f"{flag}: --broker {url} takes no password")
        return None
    if not _wanted(url, flag, password_file, "mqtts://ACCOUNT@host:port"):
        return None
    return _from_sources(
        flag, password_file, BROKER_PASSWORD_ENV, BROKER_PASSWORD_FILE_ENV, environ
    )


def db_password(url: str, password_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The password for database ``url`` (``--db-password-file``, then the environment), or
    None when it needs none from elsewhere (SQLite, no user, or its own password)."""
    flag = "--db-password-file"
    if "://" not in url and _SCHEME.match(url):  # a mistyped URL, not a file to create
        raise ConfigError(
            f"--db: {url.partition(':')[0]}:... lacks '://'; write "
            "postgresql+psycopg://USER@host/database, or ./PATH for a SQLite file"
        )
    scheme = urlparse(url).scheme if "://" in url else "sqlite"
    if scheme.startswith("sqlite") or scheme == "memory":
        if password_file is not None:
            raise ConfigError(f"{flag}: a SQLite store takes no password")
        return None
    if not _wanted(url, flag, password_file, "postgresql+psycopg://USER@host/database"):
        return None
    return _from_sources(flag, password_file, DB_PASSWORD_ENV, DB_PASSWORD_FILE_ENV, environ)


def read_passwords(args: argparse.Namespace) -> None:
    """Give the command its broker and database passwords (None where the URL needs none) and
    refuse a malformed broker URL by name, its password masked."""
    if hasattr(args, "broker"):
        args.broker_password = broker_password(args.broker, args.broker_password_file, os.environ)
        if args.broker not in ("none", "embedded"):
            from wire.mqtt import MqttConfig

            try:
                mqtt = MqttConfig.from_url(args.broker, password=args.broker_password)
            except ValueError as error:
                raise ConfigError(f"--broker: {error}") from None
            files = {"ca": mqtt.ca_file, "cert": mqtt.cert_file, "key": mqtt.key_file}
            for name, path in files.items():
                if path and not os.access(path, os.R_OK):
                    why = "no such file" if not os.path.exists(path) else "not readable"
                    raise ConfigError(f"--broker: {name}={path}: {why}; fix the path in the URL")
    if hasattr(args, "db"):
        args.db_password = db_password(args.db, args.db_password_file, os.environ)
