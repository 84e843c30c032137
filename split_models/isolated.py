"""Profiling in a fresh process.

The training-pass working set is measured from the process's resident high-water mark, so it is
only true in a process whose heap holds nothing from earlier work: in a long-running process,
memory freed by earlier work is reused without raising the high-water mark and the estimate
comes out low (by a third after a few federated rounds, measured). Long-running roles (the
coordinator service, test sessions) therefore profile in a child process started for the
purpose, with ``MALLOC_MMAP_THRESHOLD_`` set so tensor memory leaves the resident set when freed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable

from split_models.config import ModelConfig, config_to_dict, parse_config
from split_models.errors import ConfigError, SplitError
from split_models.profiler import ModelProfile

__all__ = ["profile_in_fresh_process"]

_ERROR_EXIT = 3


def profile_in_fresh_process(
    model: ModelConfig,
    local_losses: Iterable[str] = ("linear",),
    batch_size: int | None = None,
    timeout: float = 900.0,
) -> ModelProfile:
    """:func:`~split_models.profiler.profile_model` of ``model.build()`` in a child process;
    a bad model or shape raises :class:`ConfigError` with the child's message."""
    from split_models.measure import run_measuring_child

    arguments = [
        "split_models.isolated",
        "--model",
        json.dumps(config_to_dict(model)),
        *(f"--local-loss={kind}" for kind in local_losses),
    ]
    if batch_size is not None:
        arguments += ["--batch-size", str(batch_size)]
    try:
        done = run_measuring_child(arguments, timeout)
    except subprocess.TimeoutExpired as error:
        raise ConfigError(f"profiling {model.name} took longer than {timeout:.0f} s") from error
    if done.returncode == _ERROR_EXIT:
        raise ConfigError(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"profiling {model.name} failed (exit {done.returncode}):\n{tail}")
    return ModelProfile.from_dict(json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    from split_models.runtime import configure_process

    configure_process()
    from split_models.profiler import profile_model

    parser = argparse.ArgumentParser(prog="python -m split_models.isolated")
    parser.add_argument("--model", required=True, help="the model section, as JSON")
    parser.add_argument("--local-loss", action="append", default=[])
    parser.add_argument("--batch-size", type=int)
    args = parser.parse_args(argv)
    try:
        config = parse_config(ModelConfig, json.loads(args.model), "model")
        profile = profile_model(
            config.build(seed=0), args.local_loss or ("linear",), args.batch_size, config
        )
    except (SplitError, ValueError) as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return _ERROR_EXIT
    print(json.dumps(profile.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
