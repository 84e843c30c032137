"""Attack 2, client-id takeover: a device account connecting with another device's client id
used to make the broker drop that device and publish its last will (it was recorded offline and
left out of the round). The production broker refuses the impostor at CONNECT."""

from __future__ import annotations

import time
from dataclasses import replace

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.security.conftest import ProductionBroker
from wire import topics
from wire.errors import RefusedError
from wire.flower import node_will
from wire.mqtt import MqttTransport, account_client_id
from wire.roles import node_id_for

pytestmark = pytest.mark.integration


def _raw_connect(production: ProductionBroker, account: str, client_id: str) -> str:
    """Connect with paho directly (as an attacker would, with any client id): the CONNACK."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.username_pw_set(account, production.passwords[account])
    client.tls_set(ca_certs=str(production.ca_file))
    result: list[str] = []
    client.on_connect = lambda _c, _u, _f, code, _p: result.append(str(code))
    client.connect("127.0.0.1", production.port)
    client.loop_start()
    deadline = time.monotonic() + 5
    while not result and time.monotonic() < deadline:
        time.sleep(0.02)
    client.loop_stop()
    client.disconnect()
    return result[0] if result else "no answer"


def test_client_ids_are_prefixed_with_the_account() -> None:
    assert account_client_id("pi-01", "pi-01-control") == "pi-01:pi-01-control"
    assert account_client_id("pi-01", "pi-01:stream") == "pi-01:stream"
    assert account_client_id("pi-01", "pi-01") == "pi-01"
    assert account_client_id(None, "pi-01-control") == "pi-01-control"  # development broker


def test_another_accounts_client_id_is_refused_and_the_victim_stays(
    production_broker: ProductionBroker,
) -> None:
    production = production_broker
    # the victim's agent connection, with its last will, as `edgesplit edge` makes it
    victim = MqttTransport(
        production.config("pi-02"), "pi-02-control", will=node_will(node_id_for("pi-02"), "pi-02")
    )
    watcher = MqttTransport(production.config("coordinator"), "watch")
    presence: list[bytes] = []
    watcher.subscribe(topics.presence("pi-02"), lambda _t, payload: presence.append(payload))
    time.sleep(0.3)
    # mallory tries the victim's exact client id, and the victim's id without the prefix
    assert _raw_connect(production, "mallory", victim.client_id) == "Not authorized"
    assert _raw_connect(production, "mallory", "pi-02") == "Not authorized"
    # through edgesplit's own transport the id is mallory's: it connects, and drops no one
    impostor = MqttTransport(production.config("mallory"), "pi-02-control")
    assert impostor.client_id == "mallory:pi-02-control"
    time.sleep(0.5)
    assert b"offline" not in presence, "the victim's last will was published"
    assert victim.connected
    impostor.close()
    victim.close()
    watcher.close()


def test_the_owner_of_a_client_id_still_takes_its_session_over(
    production_broker: ProductionBroker,
) -> None:
    production = production_broker
    """A restarted agent reconnects with its own id (the normal takeover) and is let in."""
    first = MqttTransport(production.config("pi-01"), "pi-01-stream")
    second = MqttTransport(production.config("pi-01"), "pi-01-stream")
    assert second.connected and second.client_id == first.client_id
    second.close()
    first.close()


def test_a_wrong_password_is_still_refused_with_a_valid_client_id(
    production_broker: ProductionBroker,
) -> None:
    production = production_broker
    config = replace(production.config("pi-01"), password="wrong", connect_timeout=3.0)
    with pytest.raises(RefusedError, match=r"refused the connection \(.+\) with account 'pi-01'"):
        MqttTransport(config, "pi-01-control")
