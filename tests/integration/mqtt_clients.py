"""Named MQTT clients of a test broker, all closed when the test is done."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

from wire.broker import Broker
from wire.mqtt import MqttConfig, MqttTransport
from wire.transport import Transport


@contextlib.contextmanager
def mqtt_clients(broker: Broker) -> Iterator[Callable[[str], Transport]]:
    """Connects named clients to ``broker`` (a unique client id each); all are closed on exit."""
    config = MqttConfig.from_url(broker.url)
    made: list[MqttTransport] = []

    def connect(name: str) -> Transport:
        made.append(MqttTransport(config, f"{name}-{uuid.uuid4().hex[:6]}"))
        return made[-1]

    try:
        yield connect
    finally:
        for transport in made:
            transport.close()
