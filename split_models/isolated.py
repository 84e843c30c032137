"""Profiling in a fresh process.

The training-pass working set is measured from the process's resident high-water mark, so it is
only true in a process whose heap holds nothing from earlier work: in a long-running process,
memory freed by earlier work is reused without raising the high-water mark and the estimate
comes out low (by a third after a few federated rounds, measured). Long-running roles (the
coordinator service, test sessions) therefore profile in a child process started for the
purpose, with ``MALLOC_MMAP_THRESHOLD_`` set so tensor memory leaves the resident set when freed.

A profile takes 6 s (the zoo's cnn) to 30 s (MobileNetV3-small, 28 blocks) on a 2-core
machine. With a ``cache`` folder, a profile is kept as JSON under a key of everything it
depends on (the model section, local losses, batch size, the torch and Python versions, the
machine and its CPU capability, and the source of ``split_models``), so the next coordinator
or simulation of the same model on the same host and code reads it instead of measuring
again; a changed input or code is a new key. A model given by import path is never cached
(its code is not part of the key).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from split_models.config import ModelConfig, config_to_dict, parse_config
from split_models.errors import ConfigError, SplitError
from split_models.profiler import ModelProfile

__all__ = ["profile_in_fresh_process"]

log = logging.getLogger(__name__)

_ERROR_EXIT = 3


def profile_in_fresh_process(
    model: ModelConfig,
    local_losses: Iterable[str] = ("linear",),
    batch_size: int | None = None,
    timeout: float = 900.0,
    cache: Path | None = None,
) -> ModelProfile:
    """:func:`~split_models.profiler.profile_model` of ``model.build()`` in a child process,
    or the one ``cache`` holds for the same inputs; a bad model or shape raises
    :class:`ConfigError` with the child's message."""
    if ":" in model.name:  # a user's model by import path: its code is not in the key
        cache = None
    key = _cache_key(model, local_losses, batch_size) if cache is not None else ""
    if cache is not None and (kept := _cached(cache / f"{key}.json")) is not None:
        log.info("profile of %s read from the profile cache %s", model.name, cache)
        return kept
    profile = _measure(model, tuple(local_losses), batch_size, timeout)
    if cache is not None:
        _keep(cache, f"{key}.json", profile)
    return profile


def _measure(
    model: ModelConfig, local_losses: tuple[str, ...], batch_size: int | None, timeout: float
) -> ModelProfile:
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


def _cache_key(model: ModelConfig, local_losses: Iterable[str], batch_size: int | None) -> str:
    import torch

    source = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        source.update(path.read_bytes())
    inputs = {
        "model": config_to_dict(model),
        "local_losses": sorted(local_losses),
        "batch_size": batch_size,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "source": source.hexdigest(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _cached(path: Path) -> ModelProfile | None:
    """The profile kept in ``path``; None when absent or unreadable (measured again)."""
    try:
        return ModelProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(folder: Path, name: str, profile: ModelProfile) -> None:
    """Write ``profile`` atomically (a reader sees all of it or nothing); a cache that cannot
    be written is only a cache."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(profile.to_dict(), file)
        os.replace(temporary, folder / name)
    except OSError:
        pass


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
        said = error if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
        print(said, file=sys.stderr)  # a ConfigError reaches the user as its message
        return _ERROR_EXIT
    print(json.dumps(profile.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
