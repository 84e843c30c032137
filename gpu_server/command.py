"""``edgesplit gpu-server``: run a GPU server agent until stopped."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import replace

from gpu_server.agent import GpuAgent
from split_models.calibration import flops_option, measure_flops
from split_models.runtime import configure_logging, require_device, serve
from split_models.units import parse_memory
from split_models.zoo import check_model_name
from wire.flower import node_will
from wire.mqtt import MqttConfig, MqttTransport, redact_url
from wire.roles import Announcement, node_id_for

__all__ = ["gpu_server_command"]

log = logging.getLogger("edgesplit.gpu_server")


_ACCELERATOR_FLOPS = 1e13  # what --flops auto declares for an accelerator (not measured)


def _flops(option: str, device: str) -> float:
    """``--flops``: a speed, or ``auto``: measured on a CPU, :data:`_ACCELERATOR_FLOPS` on an
    accelerator. A CPU server declaring an accelerator's speed was planned as 1,000 times
    faster than it is, and the re-plan from its measured steps then moved every cut."""
    if (declared := flops_option(option)) is not None:
        return declared
    if device != "cpu":
        log.info("declaring %.3g FLOP/s on %s (--flops sets it)", _ACCELERATOR_FLOPS, device)
        return _ACCELERATOR_FLOPS
    flops = measure_flops()
    log.info("measured %.3g FLOP/s on the CPU (--flops sets a speed instead)", flops)
    return flops


def gpu_server_command(args: argparse.Namespace) -> int:
    configure_logging(args.verbose)
    return serve(lambda opened: _start(args, opened), f"GPU server {args.id}")


def _start(args: argparse.Namespace, opened: list[MqttTransport]) -> Callable[[], None]:
    """The server online; returns its stop (``opened``: its connections, as they open)."""
    require_device(args.device, "--device")
    for name in args.models:  # a typo is named now, not when a run offers the model
        check_model_name(name)
    announcement = Announcement(
        device=args.id,
        role="gpu",
        memory=parse_memory(args.memory, "--memory"),
        flops=_flops(args.flops, args.device),
        accelerator=args.device,
    )
    config = MqttConfig.from_url(args.broker, args.broker_password, fresh_session=True)
    node = node_id_for(args.id)
    control = MqttTransport(config, f"{args.id}-control", will=node_will(node, args.id))
    opened.append(control)
    # The activation stream is a shared subscription: a server that goes away must leave the
    # group at once, or the broker keeps queueing a share of every edge's batches for it.
    stream = MqttTransport(
        replace(config, session_expiry=0, clean_start=True, fresh_session=False),
        f"{args.id}-stream",
    )
    opened.append(stream)
    agent = GpuAgent(announcement, control, stream, models=args.models)
    log.info(
        "GPU server %s online (node %d, %s), broker %s",
        args.id,
        node,
        args.device,
        redact_url(args.broker),
    )

    def stop() -> None:
        agent.stop()
        control.close()
        stream.close()

    return stop
