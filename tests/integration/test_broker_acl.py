"""The shipped ACL (deploy/mosquitto/acl) on a real broker: devices write only their own topics."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from wire import topics
from wire.broker import Broker
from wire.errors import RefusedError
from wire.mqtt import MqttConfig, MqttTransport
from wire.roles import node_id_for

pytestmark = pytest.mark.integration

ACL = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto" / "acl"
ACCOUNTS = {"pi-01": "secret-1", "pi-02": "secret-2", "coordinator": "secret-c", "gpu": "secret-g"}


@pytest.fixture
def secured(tmp_path: Path) -> Broker:
    if shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto_passwd is not installed")
    passwords = tmp_path / "passwords"
    passwords.touch()
    for user, password in ACCOUNTS.items():
        subprocess.run(["mosquitto_passwd", "-b", str(passwords), user, password], check=True)
    extra = f"password_file {passwords}\nacl_file {ACL}\n"
    with Broker(extra_config=extra, anonymous=False) as broker:
        yield broker


def _connect(broker: Broker, user: str | None) -> MqttTransport:
    config = MqttConfig.from_url(broker.url, connect_timeout=3.0)
    if user is not None:
        config = replace(config, username=user, password=ACCOUNTS[user])
    return MqttTransport(config, f"{user}-{uuid.uuid4().hex[:6]}")


def test_device_may_publish_only_on_its_own_topics(secured: Broker) -> None:
    coordinator, device = _connect(secured, "coordinator"), _connect(secured, "pi-01")
    seen: list[tuple[str, bytes]] = []
    coordinator.subscribe("edgesplit/v1/#", lambda t, p: seen.append((t, p)))
    time.sleep(0.3)
    device.publish(topics.presence("pi-01"), b"online")
    device.publish(topics.presence("pi-02"), b"online")  # impersonation attempt
    device.publish(topics.activations("run-1", "seg-0", "pi-02"), b"x")  # and another
    device.flush()
    time.sleep(0.5)
    assert seen == [(topics.presence("pi-01"), b"online")]
    assert sum(device.refused.values()) == 2, device.refused
    coordinator.close()
    device.close()


def test_a_chained_gpu_server_may_pass_activations_on_under_its_id(secured: Broker) -> None:
    coordinator, gpu = _connect(secured, "coordinator"), _connect(secured, "gpu")
    seen: list[str] = []
    coordinator.subscribe("edgesplit/v1/#", lambda t, _p: seen.append(t))
    time.sleep(0.3)
    gpu.publish(topics.activations("run-1", "seg-1", "gpu-a"), b"x")
    gpu.publish(topics.done("run-1", "gpu-a"), b"n")
    gpu.flush()
    time.sleep(0.5)
    assert seen == [topics.activations("run-1", "seg-1", "gpu-a"), topics.done("run-1", "gpu-a")]
    assert sum(gpu.refused.values()) == 0, gpu.refused
    coordinator.close()
    gpu.close()


def test_anonymous_and_wrong_password_are_refused_at_once_by_name(secured: Broker) -> None:
    started = time.monotonic()
    with pytest.raises(RefusedError, match=r"refused the connection \(.+\) with no account"):
        _connect(secured, None)
    config = MqttConfig.from_url(
        secured.url, connect_timeout=3.0, username="pi-01", password="wrong"
    )
    with pytest.raises(RefusedError, match="with account 'pi-01': check the account and its"):
        MqttTransport(config, "intruder")
    assert time.monotonic() - started < 3.0, "a refusal is not waited out as unreachable"


def test_an_agent_announcing_under_another_accounts_name_stops_with_the_fix(
    secured: Broker,
) -> None:
    from flwr.clientapp import ClientApp

    from wire.roles import Announcement, go_online

    posing, device = _connect(secured, "pi-01"), _connect(secured, "pi-01")
    try:
        started = time.monotonic()
        with pytest.raises(RefusedError, match="give --id the account's name"):
            go_online(Announcement("pi-02", "edge", 1 << 20, 1e9, 1e6), posing, ClientApp())
        assert time.monotonic() - started < 5.0
        assert go_online(Announcement("pi-01", "edge", 1 << 20, 1e9, 1e6), device, ClientApp())
    finally:
        posing.close()
        device.close()


def test_a_device_is_a_flower_node_only_under_its_own_name(secured: Broker) -> None:
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp

    from wire.flower import FlowerNode, TransportGrid, node_will

    app = ClientApp()

    @app.query()
    def answer(message: Message, _context: Context) -> Message:
        return Message(RecordDict({"answer": ConfigRecord({"ok": 1})}), reply_to=message)

    grid = TransportGrid(_connect(secured, "coordinator"))
    device = _connect(secured, "pi-01")  # the will below is not set; presence is published
    mine, theirs = node_id_for("pi-01"), node_id_for("pi-02")
    FlowerNode(device, mine, app, name="pi-01")
    assert grid.wait_for_nodes(1, timeout=5) == [mine]
    message = grid.create_message(RecordDict({"q": ConfigRecord({"x": 1})}), "query", mine, "g")
    (reply,) = grid.send_and_receive([message], timeout=10)
    assert reply.content.config_records["answer"]["ok"] == 1
    # pi-01 cannot pose as pi-02's node: the broker refuses its presence and its replies there
    FlowerNode(device, theirs, app, name="pi-02")
    device.flush()
    time.sleep(0.5)
    assert grid.wait_for_nodes(2, timeout=1) == [mine]
    assert node_will(mine, "pi-01").topic.endswith("/presence/pi-01")
    device.close()
