"""MQTT over TLS: a client that trusts the broker's CA talks; one that does not is refused."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.fixtures.certs import certificates
from wire.broker import Broker, free_port
from wire.errors import TransportError
from wire.mqtt import MqttConfig, MqttTransport

pytestmark = pytest.mark.integration


@pytest.fixture
def tls_broker(tmp_path: Path) -> tuple[Broker, int, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certificates(tmp_path, "server")
    certificates(tmp_path, "other")
    port = free_port()
    extra = (
        f"listener {port} 127.0.0.1\ncafile {tmp_path / 'server-ca.crt'}\n"
        f"certfile {tmp_path / 'server.crt'}\nkeyfile {tmp_path / 'server.key'}\n"
    )
    with Broker(extra_config=extra) as broker:
        yield broker, port, tmp_path


def test_tls_with_the_right_ca_works_and_a_wrong_ca_is_refused(
    tls_broker: tuple[Broker, int, Path],
) -> None:
    _, port, certs = tls_broker
    url = f"mqtts://127.0.0.1:{port}?ca={certs / 'server-ca.crt'}"
    config = MqttConfig.from_url(url, connect_timeout=5.0)
    assert config.tls and config.port == port
    receiver = MqttTransport(config, f"tls-rx-{uuid.uuid4().hex[:6]}")
    sender = MqttTransport(config, f"tls-tx-{uuid.uuid4().hex[:6]}")
    got: list[bytes] = []
    receiver.subscribe("edgesplit/v1/tls", lambda _t, p: got.append(p))
    time.sleep(0.3)
    sender.publish("edgesplit/v1/tls", b"secret activations")
    sender.flush()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == [b"secret activations"]
    receiver.close()
    sender.close()
    wrong = MqttConfig.from_url(
        f"mqtts://127.0.0.1:{port}?ca={certs / 'other-ca.crt'}", connect_timeout=3.0
    )
    with pytest.raises(
        TransportError, match=r"TLS with the MQTT broker .* failed: .*CERTIFICATE_VERIFY"
    ):
        MqttTransport(wrong, "impostor-trust")  # it said "is it running?"
