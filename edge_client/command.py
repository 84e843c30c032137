"""``edgesplit edge``: run an edge agent until stopped."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from edge_client.agent import EdgeAgent
from split_models.calibration import flops_option, measure_flops
from split_models.data import load_dataset
from split_models.errors import ConfigError
from split_models.measure import release_freed_memory
from split_models.runtime import configure_logging, serve
from split_models.units import parse_bandwidth, parse_memory
from split_models.zoo import check_model_name
from wire.flower import node_will
from wire.mqtt import MqttConfig, MqttTransport, redact_url
from wire.roles import Announcement, node_id_for

__all__ = ["edge_command"]

log = logging.getLogger("edgesplit.edge")


def edge_command(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    return serve(lambda opened: _start(args, opened), f"edge {args.id}")


def _start(args: argparse.Namespace, opened: list[MqttTransport]) -> Callable[[], None]:
    """The edge online; returns its stop (``opened``: its connections, as they open)."""
    release_freed_memory()  # freed tensors leave the resident set: the measured peak is true
    data = load_dataset(args.data)  # bad data is named before a speed is measured
    if not len(data):  # it would come online only to refuse every assignment
        raise ConfigError(f"--data {args.data}: it holds no samples")
    for name in args.models:  # a typo is named now, not when a run offers the model
        check_model_name(name)
    declared = flops_option(args.flops)
    measured = declared is None
    announcement = Announcement(
        device=args.id,
        role="edge",
        memory=parse_memory(args.memory, "--memory"),
        flops=_measured_flops() if declared is None else declared,
        uplink=parse_bandwidth(args.uplink, "--uplink"),
    )
    config = MqttConfig.from_url(args.broker, args.broker_password, fresh_session=True)
    node = node_id_for(args.id)
    control = MqttTransport(config, f"{args.id}-control", will=node_will(node, args.id))
    opened.append(control)
    stream = MqttTransport(config, f"{args.id}-stream")
    opened.append(stream)
    agent = EdgeAgent(announcement, data, control, stream, models=args.models, time_tasks=measured)
    log.info(
        "edge %s online (node %d): %d samples, memory %s, broker %s",
        args.id,
        node,
        len(data),
        args.memory,
        redact_url(args.broker),
    )

    def stop() -> None:
        agent.node.leave()
        control.close()
        stream.close()

    return stop


def _measured_flops() -> float:
    """This machine's speed, measured (``--flops auto``); the edge also times the blocks it
    is offered, so the first plan follows the run's own model."""
    flops = measure_flops()
    log.info("measured %.3g FLOP/s (--flops sets a speed instead)", flops)
    return flops
