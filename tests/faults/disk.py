"""A checkpoint folder that fills up, for the disk-full test and ``benchmarks/faults.py``: a
small tmpfs filled to the last byte where this process may mount (root, Linux), else an
injected ENOSPC (a ``sitecustomize`` that fails ``os.fsync`` of a checkpoint's temporary file
while a flag file exists)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["INJECT", "can_mount", "full_disk", "partial_files"]

INJECT = """\
import errno, os
_flag = os.environ.get("EDGESPLIT_TEST_DISK_FULL_FLAG")
if _flag:
    _fsync = os.fsync
    def _full_fsync(fd):
        if os.path.exists(_flag) and os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _fsync(fd)
    os.fsync = _full_fsync
"""


def _mount(size: str, where: Path) -> bool:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def can_mount() -> bool:
    """Whether a tmpfs can be mounted here (tried once, on a scratch folder, at collection)."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as scratch:
        if not _mount("64k", Path(scratch)):
            return False
        _unmount(Path(scratch))
        return True


@contextlib.contextmanager
def full_disk(mode: str, folder: Path, flag: Path) -> Iterator[Callable[[], None]]:
    """``folder`` full (a tmpfs filled up, or the injection's ``flag``); yields what frees it.
    The mount is removed on exit."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if mode == "injected-oserror":
        flag.touch()
        yield lambda: flag.unlink(missing_ok=True)
        return
    if not _mount("32m", folder):
        raise AssertionError(f"mounting a tmpfs on {folder} failed (it worked at collection)")
    filler = folder / "filler.bin"
    try:
        # ENOSPC ends the loop: the disk is full
        with contextlib.suppress(OSError), filler.open("wb", buffering=0) as handle:
            while True:
                handle.write(b"\0" * 4096)
        yield lambda: filler.unlink(missing_ok=True)
    finally:
        _unmount(folder)


def partial_files(folder: Path) -> list[str]:
    """Temporary files, and checkpoint files whose content is not the hash they are named by."""
    bad = [p.name for p in folder.rglob("*.tmp")]
    for path in folder.rglob("*.safetensors"):
        if hashlib.sha256(path.read_bytes()).hexdigest() != path.name.split(".")[0]:
            bad.append(path.name)
    return bad
