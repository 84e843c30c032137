"""Transport throughput: raw paho-mqtt vs edgesplit activation batches, same mosquitto.

Raw: paho clients publish/receive opaque payloads at QoS 1. edgesplit: a Channel over
MqttTransport sends activation batches (x: float32 [B, 256], y: int64 [B]) whose fp32 size
equals the raw payload size, encoded as fp32, fp16 or int8, and the receiving Channel decodes
and validates each one (dtype, shape, finite values) before counting it. Both sides run in this
process on separate clients; the broker is a private mosquitto on loopback.

"activation MB/s" counts the fp32 bytes of the activations delivered per second (what training
consumes); "wire MB/s" counts the bytes that crossed the broker.

    python benchmarks/transport.py [--total-mb 192] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
from _report import Report, machine
from paho.mqtt.enums import CallbackAPIVersion

from wire.broker import Broker
from wire.channel import Channel
from wire.codec import Envelope, TensorSpec
from wire.mqtt import MqttConfig, MqttTransport

SIZES = {"64 KiB": 64 * 1024, "1 MiB": 1024 * 1024, "8 MiB": 8 * 1024 * 1024}
FEATURES = 256
TARGET = 0.70


def _client(port: int, name: str) -> mqtt.Client:
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=f"{name}-{uuid.uuid4().hex[:6]}",
        protocol=mqtt.MQTTv5,
    )
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def raw_paho(port: int, size: int, count: int) -> float:
    """MB/s of opaque payloads from one paho client to another."""
    topic, received, done = f"bench/raw/{uuid.uuid4().hex[:6]}", [0], threading.Event()

    def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        received[0] += 1
        if received[0] == count:
            done.set()

    subscriber, publisher = _client(port, "raw-sub"), _client(port, "raw-pub")
    subscriber.on_message = on_message
    subscriber.subscribe(topic, qos=1)
    time.sleep(0.3)
    payload = os.urandom(size)
    started = time.perf_counter()
    infos = [publisher.publish(topic, payload, qos=1) for _ in range(count)]
    done.wait(300)
    elapsed = time.perf_counter() - started
    for info in infos:
        info.wait_for_publish(10)
    for client in (subscriber, publisher):
        client.disconnect()
        client.loop_stop()
    return count * size / elapsed / 1e6


def edgesplit(port: int, size: int, count: int, encoding: str) -> tuple[float, float]:
    """(activation MB/s, wire MB/s) of validated activation batches through Channels."""
    config = MqttConfig.from_url(f"mqtt://127.0.0.1:{port}")
    tx_transport = MqttTransport(config, f"es-pub-{uuid.uuid4().hex[:6]}")
    rx_transport = MqttTransport(config, f"es-sub-{uuid.uuid4().hex[:6]}")
    sender, receiver = Channel(tx_transport, "pi-01"), Channel(rx_transport, "gpu-a")
    topic = f"edgesplit/v1/bench/act/seg/{uuid.uuid4().hex[:6]}"
    batch = size // (4 * FEATURES)
    x = np.random.default_rng(0).standard_normal((batch, FEATURES), dtype=np.float32)
    y = np.arange(batch, dtype=np.int64)
    received, done = [0], threading.Event()

    def on_batch(envelope: Envelope) -> None:
        received[0] += 1
        if received[0] == count:
            done.set()

    receiver.subscribe(
        topic,
        on_batch,
        expect={"x": TensorSpec("float32", (None, FEATURES)), "y": TensorSpec("int64", (None,))},
    )
    time.sleep(0.3)
    started = time.perf_counter()
    for _ in range(count):
        sender.send(topic, "activations", "bench", tensors={"x": x, "y": y}, encoding=encoding)
    done.wait(300)
    elapsed = time.perf_counter() - started
    wire = receiver.stats.bytes_received
    tx_transport.close()
    rx_transport.close()
    return count * x.nbytes / elapsed / 1e6, wire / elapsed / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-mb", type=int, default=192, help="data per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="median of this many runs")
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    header = (
        "| payload | raw paho MB/s | edgesplit fp32 (activation MB/s) | ratio | "
        "fp16 activation / wire MB/s | int8 activation / wire MB/s |\n"
        "|---|---|---|---|---|---|"
    )
    report = Report(header)
    verdicts = []
    with Broker() as broker:
        for label, size in SIZES.items():
            count = max(8, args.total_mb * 1024 * 1024 // size)
            raw = statistics.median(raw_paho(broker.port, size, count) for _ in range(args.repeat))
            results = {
                e: [edgesplit(broker.port, size, count, e) for _ in range(args.repeat)]
                for e in ("fp32", "fp16", "int8")
            }
            medians = {
                e: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                for e, runs in results.items()
            }
            ratio = medians["fp32"][0] / raw
            if size >= 1024 * 1024:
                verdicts.append(ratio >= TARGET)
            row = (
                f"| {label} | {raw:.0f} | {medians['fp32'][0]:.0f} | {ratio:.2f} | "
                f"{medians['fp16'][0]:.0f} / {medians['fp16'][1]:.0f} | "
                f"{medians['int8'][0]:.0f} / {medians['int8'][1]:.0f} |"
            )
            report.row(row)
    verdict = "PASS" if all(verdicts) else "FAIL"
    summary = (
        f"\ntarget: edgesplit fp32 >= {TARGET:.0%} of raw paho at 1 MiB and 8 MiB: "
        f"{verdict}; median of {args.repeat} runs of {args.total_mb} MB each; mosquitto "
        f"on loopback; {machine()}"
    )
    report.finish(summary, args.out)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
