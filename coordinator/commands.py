"""Coordinator-side command implementations called by the ``edgesplit`` CLI."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from coordinator.partitioner import PartitionConfig, plan_split
from coordinator.planner import unfit_edges
from split_models.config import ModelConfig, parse_config
from split_models.devices import load_devices
from split_models.errors import ConfigError
from split_models.options import LOCAL_LOSSES
from split_models.profiler import profile_model
from split_models.units import format_bytes

__all__ = [
    "coordinator_command",
    "parse_shape",
    "plan_command",
    "profile_cache",
    "profile_command",
]


def parse_range(text: str | None, field: str = "--input-range") -> list[int] | None:
    """Parse ``"1000"`` (ids in [0, 1000)) or ``"0,1000"`` into [low, high]."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) == 1:
        values = [0, *values]
    if len(values) != 2 or not values[0] < values[1]:
        raise ConfigError(f"{field}: expected N or LOW,HIGH with LOW < HIGH, got {text!r}")
    return values


def model_section(args: argparse.Namespace) -> ModelConfig:
    """The model section from ``--model``, ``--input-shape`` and the input flags."""
    data: dict[str, object] = {
        "model": args.model,
        "input_shape": list(parse_shape(args.input_shape)),
        "num_classes": args.num_classes,
        "input_dtype": args.input_dtype,
        "input_range": parse_range(args.input_range),
        "task": args.task,
    }
    if args.split_points:
        data["split_points"] = [p.strip() for p in args.split_points.split(",") if p.strip()]
    return parse_config(ModelConfig, data, "flags", prefix="--")


def parse_shape(text: str, field: str = "--input-shape") -> tuple[int, ...]:
    """Parse ``"1,28,28"`` (or ``"1x28x28"``) into a shape of positive sizes."""
    try:  # every part a size: "1,x" or "1,8,8," is a typo, not a shape
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
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
        cuts=args.cuts,
        mode=args.mode,
    )
    devices = load_devices(args.devices)
    model = model_section(args).build(seed=0)
    print(f"profiling {args.model} ({model.num_blocks} blocks)...", file=sys.stderr, flush=True)
    profile = profile_model(model, local_losses=(args.local_loss,), batch_size=args.batch_size)
    unfit, line = unfit_edges(profile, devices, config)
    if unfit and len(unfit) < sum(1 for d in devices if d.kind == "edge"):
        print(f"warning: left out of the plan, as the coordinator would: {line}", file=sys.stderr)
        devices = [d for d in devices if d.name not in unfit]
    plan = plan_split(profile, devices, config)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else str(plan))
    return 0


def profile_command(args: argparse.Namespace) -> int:
    """``edgesplit profile``: per-block profile of a model at a batch size."""
    model = model_section(args).build(seed=0)
    every = ("linear", "mlp") if model.options.task == "language-model" else LOCAL_LOSSES
    losses = tuple(args.local_loss or every)  # a language model's heads: a token a position
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


def profile_cache(option: str | None) -> Path | None:
    """The ``--profile-cache`` folder; None for ``none`` (or no option)."""
    return None if option in (None, "", "none") else Path(option)


def _store_shown(db: str) -> str:
    """The store ``--db`` names, for the log: a SQLite file as given, said to be new when it
    is not there yet (a PostgreSQL URL forgotten makes one), else the URL, password masked."""
    from storage import MEMORY_URLS, normalise_url, sqlite_file
    from storage.engine import shown_url

    if db in MEMORY_URLS:
        return "memory (nothing is kept once the coordinator stops)"
    if (file := sqlite_file(db)) is not None:
        return f"SQLite file {db}" + ("" if file.exists() else " (new: no such file before)")
    return shown_url(normalise_url(db))


def coordinator_command(args: argparse.Namespace) -> int:
    """``edgesplit coordinator``: run (or resume) one run to its last round."""
    from coordinator.config import load_run_config
    from coordinator.lease import RunLease
    from coordinator.service import Coordinator, CoordinatorError
    from split_models.runtime import configure_logging
    from storage import open_store
    from storage.outage import DEFAULT_OUTAGE_WAIT
    from wire.mqtt import MqttConfig, MqttTransport

    configure_logging(args.verbose)
    config = load_run_config(args.config)
    shown = _store_shown(args.db)
    wait = DEFAULT_OUTAGE_WAIT if args.db_outage_wait is None else args.db_outage_wait
    if not 0 <= wait <= 86400:
        raise ConfigError(f"--db-outage-wait: expected 0 to 86400 s, got {wait:g}")
    # a server that does not answer yet (restarting with this host, a failover) is waited for
    store = open_store(args.db, args.checkpoints, args.db_password, outage_wait=wait)
    store.check_can_commit()  # a PostgreSQL store told no checkpoint folder stops here
    broker = MqttConfig.from_url(args.broker, args.broker_password)
    try:
        # the lease first: a second coordinator of the run would knock this one off the broker
        with RunLease(store, config.run_id, ttl=args.lease_seconds) as lease:
            transport = MqttTransport(broker, f"coordinator-{config.run_id}")
            logging.getLogger("coordinator").info(
                "run %s: broker %s:%d, store %s", config.run_id, broker.host, broker.port, shown
            )
            lease.on_lost.append(transport.leave)
            transport.reconnect_gate = lease.lost_to
            try:
                ran = Coordinator(
                    config,
                    store,
                    transport,
                    max_attempts=args.max_attempts,
                    allow_config_change=args.allow_config_change,
                    profile_cache=profile_cache(args.profile_cache),
                ).run(lease)
            finally:
                transport.close()  # before the lease is given up to whoever comes next
    except CoordinatorError as error:
        print(f"edgesplit coordinator: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(f"run {config.run_id}: finished ({ran} round(s) now, {config.training.rounds} in all)")
    return 0
