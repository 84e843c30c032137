"""Content-addressed safetensors files: written, fsynced and renamed into place before any row
refers to them, verified against their SHA-256 when read. No pickle anywhere."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors.numpy import load, save

from storage.errors import CheckpointError, CheckpointWriteError
from storage.records import Tensors

__all__ = ["CheckpointFiles", "encode", "temporary_owner_gone"]

_SUFFIX = ".safetensors"
_TEMP_SUFFIX = ".tmp"
# A temporary file is named '<sha>.safetensors.<host>-<pid>.tmp': a later open on the same
# host collects it at once when that process is gone, others only once it is old.
_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64] or "host"
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temporary_owner_gone(name: str, host: str = _HOST) -> bool:
    """Whether the temporary file ``name`` was left by a process of ``host`` that has ended
    (False when it names another host or no owner: only its age can tell then)."""
    owner = name.removesuffix(_TEMP_SUFFIX).rpartition(".")[2]
    owner_host, _, pid = owner.rpartition("-")
    return owner_host == host and pid.isdigit() and not _pid_alive(int(pid))


def _write_failure(error: OSError, digest: str, root: Path) -> CheckpointWriteError:
    """One line for a checkpoint that could not be written (the run can be restarted)."""
    if error.errno in _FULL:
        reason = "no space left on device"
    else:
        reason = (error.strerror or str(error)).lower()
    return CheckpointWriteError(
        f"{reason} writing checkpoint {digest[:12]} in {root}; the round was not committed: "
        "free space (or fix the folder) and run the same command again"
    )


def encode(tensors: Tensors) -> tuple[str, bytes]:
    """The safetensors file of ``tensors`` and its SHA-256 (the file's name)."""
    # Not ``np.ascontiguousarray``: it turns a 0-d array (BatchNorm's num_batches_tracked)
    # into shape (1,).
    arrays = {name: np.require(array, requirements="C") for name, array in tensors.items()}
    payload = save(arrays, metadata={"format": "edgesplit-checkpoint-1"})
    return hashlib.sha256(payload).hexdigest(), payload


class CheckpointFiles:
    """A directory of ``<sha[:2]>/<sha>.safetensors`` files; ``readonly`` never creates,
    touches or deletes anything."""

    def __init__(self, root: str | Path, readonly: bool = False) -> None:
        self.root = Path(root)
        self.readonly = readonly
        if not readonly:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # the owner's alone

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}{_SUFFIX}"

    def put(self, tensors: Tensors) -> tuple[str, int]:
        """Store ``tensors`` durably; return (sha256, size). Storing equal content refreshes
        the file's time (so that garbage collection spares it) and writes nothing, unless the
        stored file no longer hashes to it (corrupted in place): then it is rewritten. A failed
        write leaves no file behind and raises :class:`CheckpointWriteError`."""
        digest, payload = encode(tensors)
        self.write(digest, payload)
        return digest, len(payload)

    def write(self, digest: str, payload: bytes) -> None:
        """Store ``payload`` (from :func:`encode`) durably as ``digest``'s file."""
        if self.readonly:
            raise CheckpointWriteError(f"the checkpoint folder {self.root} was opened read-only")
        target = self.path(digest)
        try:
            # equal content already stored: refreshed, not rewritten, but only when it still
            # is that content (a file corrupted in place keeps its size; it is replaced)
            if (
                target.exists()
                and target.stat().st_size == len(payload)
                and _file_sha256(target) == digest
            ):
                os.utime(target)
                return
            self._write(target, payload)
        except OSError as error:
            raise _write_failure(error, digest, self.root) from None

    @staticmethod
    def _write(target: Path, payload: bytes) -> None:
        """Temporary file, fsync, rename, directory fsync; the temporary file removed on
        any failure."""
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = target.with_name(f"{target.name}.{_HOST}-{os.getpid()}{_TEMP_SUFFIX}")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)

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
        if deep and _file_sha256(path) != sha256:
            return f"checkpoint file {sha256[:12]} does not match its hash"
        return None

    def stored(self) -> Iterator[tuple[str, Path]]:
        """Every complete file as (sha256, path)."""
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            yield path.name.removesuffix(_SUFFIX), path

    def remove(self, sha256: str) -> int:
        """Delete ``sha256``'s file; 1 when there was one, else 0."""
        return 0 if self.readonly else _unlink(self.path(sha256))

    def collect_garbage(self, referenced: set[str], older_than_seconds: float) -> int:
        """Delete files no row refers to and abandoned temporary files older than the age, and
        at once the temporary files of this host's processes that have ended."""
        if self.readonly:
            return 0
        cutoff = time.time() - older_than_seconds
        removed = 0
        candidates = [p for sha, p in self.stored() if sha not in referenced]
        for temporary in self.root.glob(f"??/*{_TEMP_SUFFIX}"):
            if temporary_owner_gone(temporary.name):
                removed += _unlink(temporary)
            else:
                candidates.append(temporary)
        for path in candidates:
            try:
                if path.stat().st_mtime <= cutoff:
                    removed += _unlink(path)
            except FileNotFoundError:
                continue
        return removed


def _unlink(path: Path) -> int:
    try:
        path.unlink()
    except FileNotFoundError:
        return 0
    return 1


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
