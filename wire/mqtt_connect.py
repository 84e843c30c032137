"""Connecting a paho MQTT v5 client (``wire.mqtt``'s and the simulation's shared one,
``wire.shared``): credentials, TLS, the reconnect back-off, and waiting for the broker's
answer, which tells an unreachable broker from a refusal no retry changes (a wrong account or
password, an ACL, a certificate signed by another CA)."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from wire.errors import RefusedError, UnreachableError
from wire.mqtt_config import MqttConfig
from wire.paho_decode import FastClient
from wire.transport import Will

__all__ = ["connect_and_wait", "note_refusal", "paho_client"]

log = logging.getLogger(__name__)


def paho_client(
    client_id: str, config: MqttConfig, will: Will | None = None, max_queued: int | None = None
) -> FastClient:
    """A paho MQTT v5 client for ``config``: credentials, TLS, ``will``, the reconnect
    back-off and ``max_queued`` outgoing messages (``config.max_queued`` when None); the
    caller sets its callbacks."""
    client = FastClient(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    if config.username is not None:
        client.username_pw_set(config.username, config.password)
    if config.tls:
        client.tls_set(
            ca_certs=config.ca_file,
            certfile=config.cert_file,
            keyfile=config.key_file,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
    if will is not None:
        client.will_set(will.topic, will.payload, qos=1, retain=will.retain)
    client.reconnect_delay_set(config.reconnect_min, config.reconnect_max)
    client.max_queued_messages_set(config.max_queued if max_queued is None else max_queued)
    return client


# CONNACK refusals no retry changes (protocol, client id, account or password, ban); a busy,
# unavailable or rate-limiting broker (0x88, 0x89, 0x9F) is waited for until connect_timeout
_DENIED = frozenset({0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C})


def note_refusal(reason: Any, refusals: list[str]) -> None:
    """Log the broker's refusal of a connection; one that no retry changes goes into
    ``refusals``, which makes :func:`connect_and_wait` raise :class:`RefusedError`."""
    log.error("MQTT connection refused: %s", reason)
    if getattr(reason, "value", None) in _DENIED:
        refusals.append(str(reason))


def connect_and_wait(
    client: mqtt.Client,
    config: MqttConfig,
    connected: threading.Event,
    clean_start: Any,
    refusals: list[str] | None = None,
) -> None:
    """Connect ``client`` in the background and wait until its ``on_connect`` sets
    ``connected``; :class:`UnreachableError` naming the broker when it cannot, and
    :class:`RefusedError` as soon as ``on_connect`` adds the broker's refusal to ``refusals``
    (:func:`note_refusal`: a wrong account or password: no use waiting, nor calling it
    unreachable)."""
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = config.session_expiry
    where = f"{config.host}:{config.port}"
    try:
        client.connect_async(
            config.host,
            config.port,
            config.keepalive,
            clean_start=clean_start,
            properties=properties,
        )
    except (OSError, ValueError) as error:
        raise UnreachableError(f"cannot reach the MQTT broker at {where}: {error}") from error
    client.loop_start()
    deadline = time.monotonic() + config.connect_timeout
    while not connected.wait(0.05) and time.monotonic() < deadline and not refusals:
        pass
    if connected.is_set():
        return
    client.loop_stop()
    if refusals:
        account = f"account {config.username!r}" if config.username else "no account"
        raise RefusedError(
            f"the MQTT broker at {where} refused the connection ({refusals[-1]}) with "
            f"{account}: check the account and its password (--broker-password-file or "
            "the URL)"
        )
    if config.tls and (failure := _tls_failure(config)) is not None:
        raise RefusedError(
            f"TLS with the MQTT broker at {where} failed: {failure}. Check the URL's ca= "
            "(the CA that signed the broker's certificate), that the host is the name the "
            "certificate was made for, and cert=/key= where the broker asks for one"
        )
    raise UnreachableError(
        f"no connection to the MQTT broker at {where} within "
        f"{config.connect_timeout:.0f} s; is it running? "
        "(`edgesplit broker` starts one for development)"
    )


def _tls_failure(config: MqttConfig) -> str | None:
    """Why a TLS handshake with the broker fails (a certificate signed by another CA than
    ``ca=``, or made for another host name), or None when it succeeds or nothing answers:
    paho retries such a failure quietly, which read as an unreachable broker."""
    try:
        context = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        with (
            socket.create_connection((config.host, config.port), timeout=3) as raw,
            context.wrap_socket(raw, server_hostname=config.host),
        ):
            return None
    except ssl.SSLError as error:
        return str(error)
    except OSError:  # nothing answers, or a file that cannot be read: said elsewhere
        return None
