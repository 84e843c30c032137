"""A device account may lie: the coordinator's grid takes a node's identity from the topic it
publishes on (its account's, under the shipped ACL), never from what the payload says."""

from __future__ import annotations

import time
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from wire import topics
from wire.flower import FlowerNode, TransportGrid, _Frames, node_id_of
from wire.roles import node_id_for
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

app = ClientApp()


@app.query()
def answer(message: Message, context: Context) -> Message:
    return Message(RecordDict({"a": ConfigRecord({"node": context.node_id})}), reply_to=message)


def _settle() -> None:
    time.sleep(0.2)


def test_a_device_cannot_announce_another_devices_node_id() -> None:
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    attacker = hub.connect("pi-01")
    # pi-01 says "online <pi-02's id>" on its own presence topic
    attacker.publish(topics.presence("pi-01"), f"online {node_id_for('pi-02')}".encode(), True)
    _settle()
    assert list(grid.get_node_ids()) == []  # ignored: pi-01's id is the one of its name
    FlowerNode(hub.connect("pi-02"), node_id_for("pi-02"), app, name="pi-02")
    assert grid.wait_for_nodes(1, timeout=5) == [node_id_for("pi-02")]
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-02"), "g")
    (reply,) = grid.send_and_receive([message], timeout=5)
    assert reply.content.config_records["a"]["node"] == node_id_for("pi-02")


def test_a_reply_on_another_devices_topic_is_dropped() -> None:
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    genuine = hub.connect("pi-02")  # online, but does not answer (yet)
    genuine.publish(topics.presence("pi-02"), f"online {node_id_for('pi-02')}".encode(), True)
    assert grid.wait_for_nodes(1, timeout=5) == [node_id_for("pi-02")]
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-02"), "g")
    (identifier,) = grid.push_messages([message])
    # pi-01 forges an answer to pi-02's message on its own reply topic
    forged = Message(RecordDict({"a": ConfigRecord({"node": 1})}), reply_to=message)
    _Frames(hub.connect("pi-01")).send(topics.flower_out("pi-01"), forged)
    _settle()
    assert list(grid.pull_messages([identifier])) == []
    # the genuine answer on pi-02's own topic is taken
    _Frames(genuine).send(topics.flower_out("pi-02"), forged)
    _settle()
    assert len(list(grid.pull_messages([identifier]))) == 1


def test_a_node_must_carry_the_id_of_its_name() -> None:
    with pytest.raises(ValueError, match="derives a node's id from its name"):
        FlowerNode(InProcessHub().connect("x"), 7, app, name="pi-01")
    assert node_id_of("7") == 7 and node_id_of("pi-01") == node_id_for("pi-01")


def test_a_replayed_message_is_handled_once() -> None:
    handled = []
    counting = ClientApp()

    @counting.query()
    def count(message: Message, context: Context) -> Message:
        handled.append(message.metadata.message_id)
        return Message(RecordDict(), reply_to=message)

    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    FlowerNode(hub.connect("pi-01"), node_id_for("pi-01"), counting, name="pi-01")
    assert grid.wait_for_nodes(1, timeout=5)
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-01"), "g")
    assert len(list(grid.send_and_receive([message], timeout=5))) == 1
    _Frames(hub.connect("replayer")).send(topics.flower_in("pi-01"), message)  # again
    _settle()
    assert handled == [message.metadata.message_id]


def test_a_frame_declaring_a_huge_message_does_not_block_real_replies() -> None:
    import json
    import struct

    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    FlowerNode(hub.connect("pi-02"), node_id_for("pi-02"), app, name="pi-02")
    assert grid.wait_for_nodes(1, timeout=5)
    header = json.dumps(
        {"id": "junk", "index": 0, "count": 1 << 20, "total": 1 << 30, "sha256": "0" * 64}
    ).encode()
    junk = b"ESC1" + struct.pack("<I", len(header)) + header + b"x" * 1024
    attacker = hub.connect("pi-01")
    for _ in range(3):
        attacker.publish(topics.flower_out("pi-01"), junk)
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-02"), "g")
    (reply,) = grid.send_and_receive([message], timeout=5)
    assert reply.content.config_records["a"]["node"] == node_id_for("pi-02")


def test_a_reply_is_stamped_with_the_node_its_topic_names() -> None:
    """What a reply says of its sender is not believed: a device must not pass for another
    (a trusted GPU server, say) to whoever reads ``src_node_id``."""
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    device = hub.connect("pi-02")
    device.publish(topics.presence("pi-02"), f"online {node_id_for('pi-02')}".encode(), True)
    assert grid.wait_for_nodes(1, timeout=5) == [node_id_for("pi-02")]
    message = grid.create_message(RecordDict(), "query", node_id_for("pi-02"), "g")
    (identifier,) = grid.push_messages([message])
    forged = Message(RecordDict({"a": ConfigRecord({"node": 1})}), reply_to=message)
    forged.metadata.__dict__["_src_node_id"] = node_id_for("gpu-a")  # claims to be another
    _Frames(device).send(topics.flower_out("pi-02"), forged)
    _settle()
    (reply,) = grid.pull_messages([identifier])
    assert reply.metadata.src_node_id == node_id_for("pi-02")


def _awaiting_pi02() -> tuple[TransportGrid, Any, str]:
    """A grid, pi-02's connection (online as incarnation a...a), and a message sent to it that
    it has not answered."""
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    device, node = hub.connect("pi-02"), node_id_for("pi-02")
    device.publish(topics.presence("pi-02"), f"online {node} {'a' * 16}".encode(), True)
    assert grid.wait_for_nodes(1, timeout=5) == [node]
    (identifier,) = grid.push_messages([grid.create_message(RecordDict(), "query", node, "g")])
    return grid, device, identifier


def test_a_node_back_as_a_new_process_fails_the_messages_its_old_one_had() -> None:
    # an edge killed mid-round and restarted at once is online again within the will's grace;
    # its new process never saw the task, so the grid answers for the old one at once
    grid, device, identifier = _awaiting_pi02()
    node = node_id_for("pi-02")
    device.publish(topics.presence("pi-02"), f"online {node} {'a' * 16}".encode(), True)
    _settle()  # the same process reconnecting (a broker restart) is no restart
    assert list(grid.pull_messages([identifier])) == []
    device.publish(topics.presence("pi-02"), b"offline", True)
    device.publish(topics.presence("pi-02"), f"online {node} {'b' * 16}".encode(), True)
    _settle()
    (reply,) = grid.pull_messages([identifier])
    assert reply.has_error() and "pi-02 restarted" in reply.error.reason
    assert reply.metadata.reply_to_message_id == identifier
    assert list(grid.get_node_ids()) == [node]  # online for the work that follows


def test_a_malformed_incarnation_is_no_restart() -> None:
    grid, device, identifier = _awaiting_pi02()
    node = node_id_for("pi-02")
    for lie in (b"Z" * 16, b"a" * 5000, b"", "é".encode() * 8):
        device.publish(topics.presence("pi-02"), f"online {node} ".encode() + lie, True)
    _settle()
    assert list(grid.pull_messages([identifier])) == []
    assert list(grid.get_node_ids()) == [node]


def test_a_name_on_another_names_node_id_is_refused_and_cannot_take_it_offline() -> None:
    # a device named with the number of another's id (the one way left to share an id):
    # the first to come online keeps it; the second is ignored, online or offline
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    first = node_id_for("pi-02")
    FlowerNode(hub.connect("pi-02"), first, app, name="pi-02")
    assert grid.wait_for_nodes(1, timeout=5) == [first]
    clash = hub.connect(str(first))
    clash.publish(topics.presence(str(first)), f"online {first}".encode(), True)
    clash.publish(topics.presence(str(first)), b"offline", True)
    _settle()
    assert list(grid.get_node_ids()) == [first]
    message = grid.create_message(RecordDict(), "query", first, "g")
    (reply,) = grid.send_and_receive([message], timeout=5)
    assert reply.content.config_records["a"]["node"] == first


def test_names_get_ids_of_63_bits_that_do_not_clash() -> None:
    # two names a 31-bit CRC gave one id (found by a user-style trial)
    assert node_id_for("edge-r0uybk8o") != node_id_for("edge-uf356rfu")
    ids = {node_id_for(f"edge-{n}") for n in range(20_000)}
    assert len(ids) == 20_000
    assert all(1 <= i < 2**63 for i in ids)
    assert max(ids) > 2**62  # the whole range is used, not 31 bits of it


def test_an_offline_said_of_a_running_node_is_contradicted_at_once() -> None:
    # a forged offline (an account allowed to write others' presence), or a will the broker
    # delivers after the node reconnected: the node says online again within the will's grace
    from wire.presence import PresenceWatch, WillGrace

    hub = InProcessHub()
    node = FlowerNode(hub.connect("pi-02"), node_id_for("pi-02"), app, name="pi-02")
    watch = PresenceWatch(hub.connect("gpu-a"), WillGrace(grace=0.5, after_reconnect=0.0))
    assert watch.offline(["pi-02"]) == []
    seen: list[bytes] = []
    hub.connect("log").subscribe(topics.presence("pi-02"), lambda t, p: seen.append(p))
    _settle()
    hub.connect("rogue").publish(topics.presence("pi-02"), b"offline", True)
    time.sleep(1.0)  # past the grace
    assert watch.offline(["pi-02"]) == [], "the offline was answered within the grace"
    assert seen[-2] == b"offline" and seen[-1].startswith(b"online"), seen
    node.leave()  # its own departure is not contradicted
    time.sleep(1.0)
    assert watch.offline(["pi-02"]) == ["pi-02"] and seen[-1] == b"offline"
