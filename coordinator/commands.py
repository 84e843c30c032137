"""Coordinator-side command implementations called by the ``edgesplit`` CLI."""

from __future__ import annotations

import argparse
import json
import sys

from coordinator.partitioner import PartitionConfig, plan_split
from split_models.devices import load_devices
from split_models.errors import ConfigError
from split_models.profiler import profile_model
from split_models.zoo import build_model

__all__ = ["parse_shape", "plan_command"]


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
