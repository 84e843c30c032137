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
again; a changed input or code is a new key. For a model given by import path (a user's
model), the key holds the sources beside its module (the module and the ``.py`` files in its
folder) and the network it builds (modules with their settings, tensor names and shapes): code
elsewhere that changes what the model computes without changing these (a helper in another
package) needs ``--profile-cache none`` once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
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
    key = _cache_key(model, local_losses, batch_size) if cache is not None else None
    if cache is None or key is None:  # no cache, or a user's model not built here: measured
        return _measure(model, tuple(local_losses), batch_size, timeout)
    with _measuring(cache, key):  # a second process of the same model waits, then reads
        if (kept := _cached(cache / f"{key}.json")) is not None:
            log.info("profile of %s read from the profile cache %s", model.name, cache)
            return kept
        profile = _measure(model, tuple(local_losses), batch_size, timeout)
        _keep(cache, f"{key}.json", profile)
    return profile


@contextlib.contextmanager
def _measuring(cache: Path, key: str) -> Iterator[None]:
    """Hold ``key``'s lock in ``cache`` (two simulations or coordinators of one model started
    together measured it twice, each on a loaded machine); no lock where none can be made."""
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = open(cache / f"{key}.lock", "a")  # noqa: SIM115 (closed below)
    except OSError:
        yield
        return
    with handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass  # no flock (Windows, some network file systems): measured twice at worst
        yield


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


def _cache_key(
    model: ModelConfig, local_losses: Iterable[str], batch_size: int | None
) -> str | None:
    import torch

    source = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        source.update(path.read_bytes())
    user_code = _user_code(model) if ":" in model.name else ""
    if user_code is None:
        return None
    inputs = {
        "user_code": user_code,
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


def _user_code(model: ModelConfig) -> str | None:
    """A digest of what a model given by import path is: the sources beside its module (the
    module and the ``.py`` files in its folder) and the network it builds (its modules with
    their settings, and its tensors' names, shapes and dtypes). None when it cannot be built
    here: the child then measures it, and says what is wrong."""
    digest = hashlib.sha256()
    try:
        spec = importlib.util.find_spec(model.name.partition(":")[0])
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            for path in sorted(Path(spec.origin).parent.glob("*.py")):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        built = model.build(seed=0)
        digest.update(repr(built).encode())
        for name, tensor in built.blocks.state_dict().items():
            digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
    except Exception:  # the user's code: whatever it raises, the child reports it
        return None
    return digest.hexdigest()


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
