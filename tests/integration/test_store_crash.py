"""Round commits survive SIGKILL at any moment: the store stays consistent and resumable."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from storage import open_store

pytestmark = pytest.mark.integration

KILLS = 200
# Hashing every checkpoint file ever written after every kill made the test quadratic (over two
# minutes); the newest round's contents are checked after every kill through resume() anyway,
# and every checkpoint's existence and size by the shallow check.
DEEP_CHECK_EVERY = 20
SEGMENTS = ("edge-0-2", "server-2-6")


def _tensors(round_number: int) -> dict[str, dict[str, np.ndarray]]:
    # Every value encodes the round, so a mixed-up resume is detectable.
    return {
        segment: {"w": np.full(20_000 + 1000 * i, round_number, dtype=np.float32)}
        for i, segment in enumerate(SEGMENTS)
    }


def _commit_forever(database: Path, ready: int) -> None:
    """Child process: open the store and commit rounds until killed; writes to ``ready`` once
    the store is open, so the parent's kill lands among commits, not during start-up."""
    with open_store(str(database)) as store:
        run = store.get_run("crash")
        number = (run.current_round or 0) + 1
        os.write(ready, b"1")
        while True:
            store.open_round("crash", number, ["pi-01"])
            store.commit_round(
                "crash",
                number,
                _tensors(number),
                {"edge-0-2": {"m": np.full(10, number, dtype=np.float32)}},
                {"loss": 1.0 / number},
            )
            number += 1


def test_sigkill_during_commits_leaves_a_consistent_resumable_store(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    with open_store(str(database)) as store:
        store.create_run("crash", {"model": "cnn"}, seed=0)
    rng = random.Random(0)
    survived, last_round = 0, 0
    for kill in range(1, KILLS + 1):
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child never returns
            try:
                os.close(read_end)
                _commit_forever(database, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        assert os.read(read_end, 1) == b"1", "the child could not open the store"
        os.close(read_end)
        time.sleep(rng.uniform(0.005, 0.08))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        deep = kill % DEEP_CHECK_EVERY == 0
        with open_store(str(database)) as store:
            assert store.integrity_problems(deep=deep) == []
            state = store.resume("crash")
            if state is not None:
                number = state.round.number
                assert number >= last_round, "a committed round was lost"
                for segment in SEGMENTS:
                    assert np.all(state.weights[segment]["w"] == number)
                assert np.all(state.optimizer_states["edge-0-2"]["m"] == number)
                assert state.round.metrics == {"loss": 1.0 / number}
                last_round = number
            store.collect_garbage(older_than_seconds=0)
            if deep:  # garbage collection removed nothing a committed round refers to
                assert store.integrity_problems(deep=True) == []
        survived += 1
    print(f"\nstore crash test: {survived} SIGKILLs survived, {last_round} rounds committed")
    assert survived == KILLS and last_round > 10


def test_the_store_and_its_checkpoints_are_the_owners_alone(tmp_path: Path) -> None:
    import stat

    with open_store(str(tmp_path / "runs.db")) as store:
        store.create_run("r", {"a": 1}, 0)
        store.open_round("r", 1, ["pi-01"])
        store.commit_round("r", 1, {"global": {"w": np.zeros(3, np.float32)}})
    modes = {
        path.relative_to(tmp_path).parts[-1][:8]: stat.S_IMODE(path.stat().st_mode)
        for path in tmp_path.rglob("*")
    }
    assert modes["runs.db"] == 0o600
    assert modes["runs.db."] == 0o700  # runs.db.checkpoints
    assert set(modes.values()) <= {0o600, 0o700}, modes
