"""Where and how an MQTT client connects: :class:`MqttConfig` (read from a broker URL), the
client id an account may use, and URLs with their password hidden for logs."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

__all__ = ["MqttConfig", "account_client_id", "redact_url"]


def account_client_id(username: str | None, client_id: str) -> str:
    """The MQTT client id for ``client_id`` under ``username``: ``<account>:<id>``.

    The production broker's plugin (deploy/mosquitto/clientid_bind.c) accepts only client ids
    that are the account's name or start with it and ``:``, so no account can connect with
    another's id and drop its connection (MQTT's session takeover). Account names cannot hold
    ``:`` (mosquitto's password file separates with it)."""
    if username is None or client_id == username or client_id.startswith(f"{username}:"):
        return client_id
    return f"{username}:{client_id}"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and messages); the rest as
    written, even a malformed port."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    user = parsed.netloc.rpartition("@")[0].partition(":")[0]
    host = parsed.netloc.rpartition("@")[2]
    return parsed._replace(netloc=f"{user}:***@{host}").geturl()


_UNITS = {"": 1, "K": 1024, "M": 1024 * 1024, "G": 1024 * 1024 * 1024}


def _size(text: str) -> int:
    """Bytes from ``text``: a count with an optional KiB, MiB or GiB (or K, M, G) suffix."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"broker URL: inbound={text!r}, expected bytes such as 1073741824 or 4GiB")
    return int(match[1]) * _UNITS[match[2].upper()]


@dataclass(frozen=True)
class MqttConfig:
    """Where and how to connect. ``from_url`` reads ``mqtt://user:pass@host:port`` and
    ``mqtts://...?ca=FILE&cert=FILE&key=FILE`` (TLS); ``?inbound=2GiB`` sets
    ``max_inbound_bytes``."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    keepalive: int = 30
    session_expiry: int = 3600
    clean_start: bool = False
    # Start a new session when the process starts, keep it across reconnects: for stateless
    # agents, whose queued messages from before a restart are stale.
    fresh_session: bool = False
    connect_timeout: float = 10.0
    reconnect_min: int = 1
    reconnect_max: int = 5  # a restarted broker sees every agent back within seconds
    max_payload: int = 64 * 1024 * 1024
    max_queued: int = 64
    # While ``bundle_after`` or more messages await the broker's acknowledgement, payloads of at
    # most a quarter of ``bundle_bytes`` are held back and sent to their topic together
    # (``wire.bundles``); 0 sends every payload on its own.
    bundle_bytes: int = 1024 * 1024
    bundle_after: int = 4
    # What may wait for a slow handler on one topic before its messages are dropped
    # (wire.transport.Mailbox; 0: unbounded)
    max_inbound_bytes: int = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_queued < 0:
            raise ValueError(f"max_queued: must be >= 0 (0: unbounded), got {self.max_queued}")
        if self.bundle_bytes < 0:
            raise ValueError(f"bundle_bytes: must be >= 0 (0: no bundles), got {self.bundle_bytes}")
        # a bundle stays far below what one message may carry (its frame adds up to 16 KiB)
        object.__setattr__(self, "bundle_bytes", min(self.bundle_bytes, self.max_payload // 2))
        if self.max_inbound_bytes < 0 or 0 < self.max_inbound_bytes < self.max_payload:
            raise ValueError(
                f"max_inbound_bytes: what may wait per topic must hold one message "
                f"({self.max_payload} bytes, max_payload), or be 0 (unbounded); got "
                f"{self.max_inbound_bytes} (a URL's ?inbound takes 512MiB or 2GiB)"
            )
        if self.bundle_after < 1:
            raise ValueError(f"bundle_after: must be >= 1, got {self.bundle_after}")

    @property
    def inbound_bound(self) -> int | None:
        """``max_inbound_bytes`` for a :class:`~wire.transport.Mailbox` (None: unbounded)."""
        return self.max_inbound_bytes or None

    @classmethod
    def from_url(cls, url: str, password: str | None = None, **overrides: Any) -> MqttConfig:
        """The config of broker ``url``; ``password`` is the account's when the URL names the
        account but holds no password (the CLI reads it from a file or the environment, so
        that it is in no argv)."""
        parsed = urlparse(url)
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
            # mqtt:/host:1883, mqtt:host and mqtt://:1883 parse with no host: they must not
            # mean localhost
            raise ValueError(
                f"broker URL: expected mqtt://host:port or mqtts://..., got {redact_url(url)!r}"
            )
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        tls = parsed.scheme == "mqtts"
        try:
            port = parsed.port
        except ValueError as error:
            raise ValueError(f"broker URL {redact_url(url)!r}: {error}") from None
        parsed_config = cls(
            host=parsed.hostname,
            port=port or (8883 if tls else 1883),
            username=unquote(parsed.username) if parsed.username else None,
            password=(
                unquote(parsed.password)
                if parsed.password
                else password
                if parsed.username
                else None
            ),
            tls=tls,
            ca_file=query.get("ca"),
            cert_file=query.get("cert"),
            key_file=query.get("key"),
        )
        if "inbound" in query:  # max_inbound_bytes, e.g. ?inbound=2GiB (0: unbounded)
            parsed_config = replace(parsed_config, max_inbound_bytes=_size(query["inbound"]))
        return replace(parsed_config, **overrides)
