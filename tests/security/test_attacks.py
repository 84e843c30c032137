"""The audit's attacks, replayed against the production broker (TLS, an account per device,
the shipped ACL, the client-id plugin) and edgesplit's real components on it.

Each test plays a compromised device account, ``mallory`` (or a participant's own account
where the attack needs one), and checks the attack fails while the genuine device keeps
working. Attack 2 (client-id takeover) is in test_client_ids.py, attack 7 (secrets) in
test_secrets.py, poisoned updates in test_poisoned_updates.py, and a fuzzed run in
test_fuzz.py.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from coordinator.devices import DeviceRegistry
from tests.security.conftest import ProductionBroker
from tests.unit.test_session import _until
from wire import topics
from wire.channel import Channel
from wire.flower import FlowerNode, TransportGrid, _Frames, node_will
from wire.mqtt import MqttTransport
from wire.roles import Announcement, Task, node_id_for
from wire.session import SessionWatch, new_session

pytestmark = pytest.mark.integration

handled: list[str] = []
app = ClientApp()


@app.query()
def answer(message: Message, context: Context) -> Message:
    handled.append(message.metadata.message_id)
    return Message(RecordDict({"a": ConfigRecord({"node": context.node_id})}), reply_to=message)


class _Accounts:
    """Connections on the production broker, closed at the end of the test."""

    def __init__(self, broker: ProductionBroker) -> None:
        self.broker = broker
        self.made: list[MqttTransport] = []

    def __call__(self, account: str, name: str, **kwargs: object) -> MqttTransport:
        transport = MqttTransport(self.broker.config(account), name, **kwargs)  # type: ignore[arg-type]
        self.made.append(transport)
        return transport

    def node(self, device: str) -> FlowerNode:
        node = node_id_for(device)
        control = self(device, f"{device}-control", will=node_will(node, device))
        return FlowerNode(control, node, app, name=device)


@pytest.fixture
def accounts(production_broker: ProductionBroker) -> Iterator[_Accounts]:
    made = _Accounts(production_broker)
    yield made
    for transport in made.made:
        transport.close()


def _refused(transport: MqttTransport, count: int) -> None:
    transport.flush()
    _until(lambda: sum(transport.refused.values()) >= count)
    assert sum(transport.refused.values()) == count, transport.refused


def test_attack1_impersonation_fails(accounts: _Accounts) -> None:
    coordinator = accounts("coordinator", "coordinator-test")
    grid = TransportGrid(coordinator)
    registry = DeviceRegistry(coordinator, grid)
    mallory = accounts("mallory", "mallory-control")
    time.sleep(0.3)
    pi01 = Announcement("pi-01", "edge", 1 << 30, 1e12, 1e6)
    # on its own topics: another's node id, another's capabilities
    mallory.publish(topics.presence("mallory"), f"online {node_id_for('pi-01')}".encode(), True)
    mallory.publish(topics.capabilities("mallory"), pi01.to_json(), True)
    # on the victim's topics (the retained forgery that held two coordinator restarts)
    mallory.publish(topics.presence("pi-01"), f"online {node_id_for('pi-01')}".encode(), True)
    mallory.publish(topics.capabilities("pi-01"), pi01.to_json(), True)
    _refused(mallory, 2)
    time.sleep(0.3)
    assert list(grid.get_node_ids()) == [] and registry.online() == {}
    # the genuine pi-01 comes: its node is pi-01's, and only it answers pi-01's messages
    accounts.node("pi-01")
    accounts("pi-01", "pi-01-caps").publish(topics.capabilities("pi-01"), pi01.to_json(), True)
    assert grid.wait_for_nodes(1, timeout=5) == [node_id_for("pi-01")]
    _until(lambda: registry.online())
    assert list(registry.online()) == ["pi-01"]
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-01"), "g")
    (identifier,) = grid.push_messages([message])
    forged = Message(RecordDict({"a": ConfigRecord({"node": 1})}), reply_to=message)
    _Frames(mallory).send(topics.flower_out("pi-01"), forged)  # refused by the ACL
    _Frames(mallory).send(topics.flower_out("mallory"), forged)  # dropped by the grid
    _refused(mallory, 3)
    time.sleep(1.0)  # a forged reply that got through would have come by now
    (reply,) = grid.pull_messages([identifier])
    assert reply.content.config_records["a"]["node"] == node_id_for("pi-01")


def test_attack3_no_account_but_the_coordinator_can_send_a_task(accounts: _Accounts) -> None:
    accounts.node("pi-01")
    mallory = accounts("mallory", "mallory-control")
    time.sleep(0.3)
    task = Task("run-1", {"name": "os:abort"}, {"round_deadline": "1e12s"}, 0, 2)
    message = Message(
        RecordDict({"task": ConfigRecord({"task": task.to_json()})}), node_id_for("pi-01"), "train"
    )
    _Frames(mallory).send(topics.flower_in("pi-01"), message)
    gpu = accounts("gpu", "gpu-control")  # a GPU server's account reads inboxes, never writes
    _Frames(gpu).send(topics.flower_in("pi-01"), message)
    _refused(mallory, 1)
    _refused(gpu, 1)


def test_attack4_poisoned_activations_are_refused_by_the_broker_or_the_stream(
    accounts: _Accounts,
) -> None:
    """A device can stream only into its own topic (an envelope's sender is not its
    identity: the topic is), and values that would overflow the back are refused there."""
    server = Channel(accounts("gpu", "gpu-stream"), "gpu-a")
    got: list[tuple[str, str]] = []
    server.subscribe(
        topics.activations_filter("run-1", "seg-1"), lambda e: got.append((e.sender, e.kind))
    )
    time.sleep(0.3)
    mallory_transport = accounts("mallory", "mallory-stream")
    mallory = Channel(mallory_transport, "pi-01")  # claims to be pi-01 in the envelope
    huge = np.full((4, 8), 3e38, dtype=np.float32)
    mallory.send(
        topics.activations("run-1", "seg-1", "pi-01"),
        "activations",
        "run-1",
        tensors={"x": huge, "y": np.zeros(4, np.int64)},
    )
    _refused(mallory_transport, 1)
    assert got == []


def test_attack5_a_frame_declaring_a_huge_message_does_not_block_real_replies(
    accounts: _Accounts,
) -> None:
    coordinator = accounts("coordinator", "coordinator-test")
    grid = TransportGrid(coordinator)
    accounts.node("pi-02")
    assert grid.wait_for_nodes(1, timeout=5) == [node_id_for("pi-02")]
    header = json.dumps(
        {"id": "junk", "index": 0, "count": 1 << 20, "total": 1 << 30, "sha256": "0" * 64}
    ).encode()
    junk = b"ESC1" + struct.pack("<I", len(header)) + header + b"x" * 1024
    mallory = accounts("mallory", "mallory-control")
    for _ in range(50):
        mallory.publish(topics.flower_out("mallory"), junk)
    mallory.flush()
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-02"), "g")
    (reply,) = grid.send_and_receive([message], timeout=10)
    assert reply.content.config_records["a"]["node"] == node_id_for("pi-02")


def test_attack5_a_forged_session_cannot_be_published(accounts: _Accounts) -> None:
    """Only the coordinator's account writes a run's session; a device follows the latest."""
    coordinator = accounts("coordinator", "coordinator-test")
    mine = new_session()
    coordinator.publish(topics.coordinator("run-1"), mine.encode(), True)
    device = SessionWatch(accounts("pi-01", "pi-01-stream"))
    device.watch("run-1")
    _until(lambda: device.replaced("run-1", "f" * 16 + "-00000000"))  # announced
    mallory = accounts("mallory", "mallory-control")
    mallory.publish(topics.coordinator("run-1"), ("f" * 16 + "-deadbeef").encode(), True)
    _refused(mallory, 1)
    time.sleep(0.3)
    assert not device.replaced("run-1", mine)


def test_attack6_a_task_is_handled_once(accounts: _Accounts) -> None:
    handled.clear()
    coordinator = accounts("coordinator", "coordinator-test")
    grid = TransportGrid(coordinator)
    accounts.node("pi-01")
    assert grid.wait_for_nodes(1, timeout=5)
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-01"), "g")
    assert len(list(grid.send_and_receive([message], timeout=5))) == 1
    # replayed: by a device (refused by the broker) and by the coordinator's account itself
    mallory = accounts("mallory", "mallory-control")
    _Frames(mallory).send(topics.flower_in("pi-01"), message)
    _Frames(coordinator).send(topics.flower_in("pi-01"), message)
    _refused(mallory, 1)
    time.sleep(0.5)
    assert handled == [message.metadata.message_id]


def test_attack5_one_senders_incomplete_chunks_do_not_block_anothers_stream() -> None:
    """The stream keeps each topic's (each sender's) incomplete messages apart."""
    from wire.chunks import split
    from wire.transport import InProcessHub

    hub = InProcessHub()
    receiver = Channel(hub.connect("gpu"), "gpu-a", chunk_bytes=1024, max_message_bytes=64 * 1024)
    got: list[str] = []
    receiver.subscribe(topics.activations_filter("run-1", "seg-1"), lambda e: got.append(e.sender))
    attacker = hub.connect("pi-03")
    # pi-03 sends the first halves of messages that fill its whole reassembly budget
    for _ in range(8):
        frames = list(split(b"z" * 16 * 1024, 1024))
        for frame in frames[:-1]:
            attacker.publish(topics.activations("run-1", "seg-1", "pi-03"), frame)
    sender = Channel(hub.connect("pi-01"), "pi-01", chunk_bytes=1024)
    sender.send(
        topics.activations("run-1", "seg-1", "pi-01"),
        "activations",
        "run-1",
        tensors={"x": np.ones((4, 1024), np.float32), "y": np.zeros(4, np.int64)},
    )  # chunked: 16 KiB in 1 KiB frames
    _until(lambda: got)
    assert got == ["pi-01"]
    assert receiver.stats.rejected["oversize"] > 0  # pi-03 hit its own bound, no one else's


def test_attack4_the_activation_bound_is_the_runs_setting() -> None:
    """``max_activation`` (RUN.yaml) reaches the GPU stage: a tighter bound refuses more."""
    from gpu_server.stage import BackStage
    from split_models.config import TrainingConfig
    from split_models.zoo import build_model
    from wire.codec import Envelope
    from wire.errors import WireError

    assert TrainingConfig(rounds=1).max_activation == 1e8
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    spec = BackStage(model, 1, model.num_blocks).cut_specs[1][0]
    batch = {"x": np.full((4, *spec.shape[1:]), 500.0, np.float32), "y": np.zeros(4, np.int64)}
    envelope = Envelope("activations", "r", "pi-01", 0, 1, {"cut": 1}, batch)
    BackStage(model, 1, model.num_blocks).train(envelope)  # 500 is fine by default
    tight = BackStage(model, 1, model.num_blocks, max_activation=100.0)
    with pytest.raises(WireError, match="magnitude 500, above the 100"):
        tight.train(envelope)


def test_attack4_a_forged_envelope_sender_cannot_mark_anothers_batches_seen() -> None:
    """Channels de-duplicate per topic: pi-03 replaying pi-01's header (sender, epoch,
    sequence number) on its own topic does not make pi-01's real batch a duplicate."""
    from dataclasses import replace

    from wire.codec import Envelope, encode
    from wire.transport import InProcessHub

    hub = InProcessHub()
    receiver = Channel(hub.connect("gpu"), "gpu-a")
    got: list[str] = []
    receiver.listen(
        topics.activations_filter("run-1", "seg-1"), lambda topic, _e: got.append(topic)
    )
    batch = {"x": np.ones((2, 3), np.float32), "y": np.zeros(2, np.int64)}
    real = Envelope("activations", "run-1", "pi-01", 0, 1, {"epoch": "e" * 16}, batch)
    forged = replace(real, tensors={"x": np.zeros((2, 3), np.float32), "y": batch["y"]})
    hub.connect("pi-03").publish(topics.activations("run-1", "seg-1", "pi-03"), encode(forged))
    hub.connect("pi-01").publish(topics.activations("run-1", "seg-1", "pi-01"), encode(real))
    _until(lambda: len(got) == 2)
    assert sorted(got) == [
        topics.activations("run-1", "seg-1", "pi-01"),
        topics.activations("run-1", "seg-1", "pi-03"),
    ]


def test_attack1_a_device_cannot_pass_itself_off_as_a_gpu_server(accounts: _Accounts) -> None:
    """GPU servers announce on ``servers/<id>``, which only the servers' account may write;
    an edge account announcing the role on its own topic is not taken for a server."""
    coordinator = accounts("coordinator", "coordinator-test")
    grid = TransportGrid(coordinator)
    registry = DeviceRegistry(coordinator, grid)
    accounts.node("mallory")  # online as a Flower node, as any device may be
    mallory = accounts("mallory", "mallory-caps")
    claim = Announcement("mallory", "gpu", 1 << 40, 1e15)
    mallory.publish(topics.capabilities("mallory"), claim.to_json(), True)
    mallory.publish(topics.servers("mallory"), claim.to_json(), True)
    _refused(mallory, 1)
    gpu = accounts("gpu", "gpu-a-control")
    FlowerNode(gpu, node_id_for("gpu-a"), app, name="gpu-a")
    gpu.publish(topics.servers("gpu-a"), Announcement("gpu-a", "gpu", 1 << 33, 1e9).to_json(), True)
    _until(lambda: registry.online("gpu"))
    time.sleep(0.3)
    assert list(registry.online("gpu")) == ["gpu-a"]
    assert "mallory" not in registry.online()
