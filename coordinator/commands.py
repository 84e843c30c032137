"""Coordinator-side command implementations called by the ``edgesplit`` CLI."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from coordinator.partitioner import PartitionConfig, plan_split
from split_models.devices import load_devices
from split_models.errors import ConfigError
from split_models.profiler import profile_model
from split_models.units import format_bytes
from split_models.zoo import build_model

__all__ = [
    "coordinator_command",
    "parse_shape",
    "plan_command",
    "profile_command",
    "simulate_command",
]


def parse_shape(text: str, field: str = "--input-shape") -> tuple[int, ...]:
    """Parse ``"1,28,28"`` (or ``"1x28x28"``) into a shape of positive sizes."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ConfigError(f"{field}: expected positive sizes such as 1,28,28, got {text!r}")
    return shape


def plan_command(args: argparse.Namespace) -> int:
    """``edgesplit plan``: profile the model, plan against the devices, print the plan."""
    config = PartitionConfig(
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        local_loss=args.local_loss,
        compression=args.compression,
        min_edge_blocks=args.min_edge_blocks,
    )
    devices = load_devices(args.devices)
    model = build_model(args.model, parse_shape(args.input_shape), args.num_classes, seed=0)
    print(f"profiling {args.model} ({model.num_blocks} blocks)...", file=sys.stderr, flush=True)
    profile = profile_model(model, local_losses=(args.local_loss,), batch_size=args.batch_size)
    plan = plan_split(profile, devices, config)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else str(plan))
    return 0


def profile_command(args: argparse.Namespace) -> int:
    """``edgesplit profile``: per-block profile of a model at a batch size."""
    model = build_model(args.model, parse_shape(args.input_shape), args.num_classes, seed=0)
    losses = tuple(args.local_loss or ("linear", "mlp", "supcon"))
    profile = profile_model(model, local_losses=losses, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(profile.to_dict()))
        return 0
    print(
        f"{'block':>5} {'layers':<28} {'params':>10} {'output':>16} {'saved/sample':>13} "
        f"{'pass/sample':>12} {'MFLOP/sample':>13}"
    )
    for index, block in enumerate(profile.blocks):
        shape = "x".join(map(str, block.output_shape))
        print(
            f"{index:>5} {block.summary[:28]:<28} {format_bytes(block.param_bytes):>10} "
            f"{shape:>16} {format_bytes(block.saved_bytes):>13} "
            f"{format_bytes(block.backward_bytes):>12} {block.flops / 1e6:>13.2f}"
        )
    return 0


def coordinator_command(args: argparse.Namespace) -> int:
    """``edgesplit coordinator``: run (or resume) one run to its last round."""
    from coordinator.config import load_run_config
    from coordinator.service import Coordinator, CoordinatorError
    from edgesplit.agents import configure_logging
    from storage import open_store
    from wire.mqtt import MqttConfig, MqttTransport

    configure_logging(args.verbose)
    config = load_run_config(args.config)
    store = open_store(args.db)
    transport = MqttTransport(MqttConfig.from_url(args.broker), f"coordinator-{config.run_id}")
    try:
        ran = Coordinator(config, store, transport, max_attempts=args.max_attempts).run()
    except CoordinatorError as error:
        print(f"edgesplit coordinator: {error}", file=sys.stderr)
        return 1
    finally:
        transport.close()
        store.close()
    print(f"run {config.run_id}: finished ({ran} round(s) now, {config.rounds} in all)")
    return 0


def simulate_command(args: argparse.Namespace) -> int:
    """``edgesplit simulate``: every role in this process; outputs into ``--out``."""
    import logging
    from pathlib import Path

    from coordinator.progress import RoundProgress
    from coordinator.service import RoundObserver
    from coordinator.simulate import load_sim_config, simulate
    from edgesplit.agents import configure_logging

    configure_logging(args.verbose)
    if not args.verbose:  # the progress display says what the log would
        logging.getLogger().setLevel(logging.WARNING)
    overrides = {
        "method": args.method,
        "rounds": args.rounds,
        "clients": args.clients,
        "data": args.data,
        "test_data": args.test_data,
        "seed": args.seed,
        "workers": args.workers,
        "batched": args.batched,
    }
    config = load_sim_config(args.config, overrides)
    out = Path(args.out)
    title = f"{config.method}: {config.clients} clients, {config.raw['model']}"
    if args.quiet or config.method == "centralized":
        summary = simulate(config, out, broker=args.broker, observer=RoundObserver())
    else:
        with RoundProgress(int(config.raw["rounds"]), title) as progress:
            summary = simulate(config, out, broker=args.broker, observer=progress)
    _print_summary(summary, out)
    return 0


def _print_summary(summary: dict[str, object], out: object) -> None:
    rounds: list[dict[str, Any]] = summary["rounds"]  # type: ignore[assignment]
    clients: list[dict[str, Any]] = summary["clients"]  # type: ignore[assignment]
    print(f"\nsimulation {summary['run_id']} ({summary['method']}), outputs in {out}/")
    print(
        f"{'round':>5} {'accuracy':>9} {'loss':>8} {'trained':>7} {'MB up':>8} {'MB down':>8} "
        f"{'wall s':>7} {'sim s':>7}"
    )
    for row in rounds:
        print(
            f"{row['round']:>5} {row['accuracy'] or 0:>9.4f} {row['loss'] or 0:>8.4f} "
            f"{row.get('participants', 0):>7} "
            f"{row['bytes_up'] / 1e6:>8.2f} {row['bytes_down'] / 1e6:>8.2f} "
            f"{row['wall_seconds'] or 0:>7.1f} {row['simulated_seconds'] or 0:>7.2f}"
        )
    if clients:
        print(
            f"{'client':<12} {'profile':<8} {'blocks':<8} {'budget':>10} {'estimate':>10} "
            f"{'measured':>10} {'cut MB up':>9} {'examples':>8}"
        )
    for client in clients:
        blocks = client["blocks"] or ["-", "-"]
        measured = client.get("measured_peak_bytes")
        print(
            f"{client['name']:<12} {client['profile']:<8} [{blocks[0]}, {blocks[1]})".ljust(31)
            + f" {format_bytes(client['budget_bytes']):>10} "
            f"{format_bytes(client['estimated_peak_bytes'] or 0):>10} "
            f"{format_bytes(measured) if measured else '-':>10} "
            f"{client.get('cut_bytes_up', 0) / 1e6:>9.2f} {client['examples']:>8}"
            + ("  does not fit its budget" if client.get("fits") is False else "")
        )
    print(
        f"final accuracy {summary['final_accuracy']:.4f}, "
        f"wall {summary['total_wall_seconds']:.1f} s "
        f"(training {summary.get('training_wall_seconds', 0.0):.1f} s), "
        f"simulated {summary['total_simulated_seconds']:.1f} s on the declared devices"
    )
