"""Content-addressed safetensors files: written, fsynced and renamed into place before any row
refers to them, verified against their SHA-256 when read. No pickle anywhere."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors.numpy import load, save

from storage.errors import CheckpointError
from storage.records import Tensors

__all__ = ["CheckpointFiles"]

_SUFFIX = ".safetensors"
_TEMP_SUFFIX = ".tmp"


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class CheckpointFiles:
    """A directory of ``<sha[:2]>/<sha>.safetensors`` files."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # the owner's alone

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}{_SUFFIX}"

    def put(self, tensors: Tensors) -> tuple[str, int]:
        """Store ``tensors`` durably; return (sha256, size). Storing equal content is a no-op."""
        # Not ``np.ascontiguousarray``: it turns a 0-d array (BatchNorm's num_batches_tracked)
        # into shape (1,).
        arrays = {name: np.require(array, requirements="C") for name, array in tensors.items()}
        payload = save(arrays, metadata={"format": "edgesplit-checkpoint-1"})
        digest = hashlib.sha256(payload).hexdigest()
        target = self.path(digest)
        if target.exists() and target.stat().st_size == len(payload):
            return digest, len(payload)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = target.with_name(f"{target.name}.{os.getpid()}{_TEMP_SUFFIX}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
        _fsync_directory(target.parent)
        return digest, len(payload)

    def get(self, sha256: str, size_bytes: int | None = None) -> dict[str, np.ndarray]:
        """Read and verify a file; raise :class:`CheckpointError` if missing or corrupt."""
        path = self.path(sha256)
        try:
            payload = path.read_bytes()
        except FileNotFoundError as error:
            raise CheckpointError(f"checkpoint {sha256[:12]} is missing at {path}") from error
        if size_bytes is not None and len(payload) != size_bytes:
            raise CheckpointError(
                f"checkpoint {sha256[:12]} has {len(payload)} bytes, expected {size_bytes}"
            )
        if hashlib.sha256(payload).hexdigest() != sha256:
            raise CheckpointError(f"checkpoint {sha256[:12]} does not match its hash")
        return load(payload)

    def check(self, sha256: str, size_bytes: int, deep: bool = False) -> str | None:
        """A problem with the stored file, or None. ``deep`` also verifies the hash."""
        path = self.path(sha256)
        if not path.exists():
            return f"checkpoint file {sha256[:12]} is missing"
        if path.stat().st_size != size_bytes:
            return f"checkpoint file {sha256[:12]} has the wrong size"
        if deep and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            return f"checkpoint file {sha256[:12]} does not match its hash"
        return None

    def stored(self) -> Iterator[tuple[str, Path]]:
        """Every complete file as (sha256, path)."""
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            yield path.name.removesuffix(_SUFFIX), path

    def collect_garbage(self, referenced: set[str], older_than_seconds: float) -> int:
        """Delete files no row refers to and abandoned temporary files older than the age."""
        cutoff = time.time() - older_than_seconds
        removed = 0
        candidates = [p for sha, p in self.stored() if sha not in referenced]
        candidates += list(self.root.glob(f"??/*{_TEMP_SUFFIX}"))
        for path in candidates:
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
