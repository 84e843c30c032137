"""Run the ``edgesplit`` command as a user would: a separate process from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgesplit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
