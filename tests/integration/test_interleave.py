"""A simulation's clients train a round at once, in turns by step (``interleave``,
simulation.pace): the GPU server receives their batches mixed, as from a deployment's edges,
not one client's round after another's (simulations on the bundled digits, in-process, one
worker)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gpu_server.trainer import BackTrainer
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from wire.codec import Envelope

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")


def _senders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fields: Any) -> list[str]:
    """The senders of the batches the GPU server trained, in the order it trained them."""
    seen: list[str] = []
    lock = threading.Lock()
    train = BackTrainer._train

    def spy(self: BackTrainer, envelope: Envelope) -> None:
        with lock:
            seen.append(envelope.sender)
        train(self, envelope)

    config = parse_sim_config(
        {"clients": 3, "rounds": 1, "measure_memory": False, "workers": 1, "batch_size": 16}
        | fields
    )
    with monkeypatch.context() as patch:
        patch.setattr(BackTrainer, "_train", spy)
        simulate(config, tmp_path / "run")
    return seen


def _runs(senders: list[str]) -> int:
    """How many runs of one sender's batches in a row the sequence has."""
    return sum(1 for i, s in enumerate(senders) if i == 0 or senders[i - 1] != s)


def test_the_server_receives_the_clients_batches_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = _senders(tmp_path / "on", monkeypatch)
    alone = _senders(tmp_path / "off", monkeypatch, interleave=False)

    clients = sorted(set(mixed))
    assert len(clients) == 3 and sorted(set(alone)) == clients
    assert _runs(alone) == 3, "without interleave: each client's round in one piece"
    assert _runs(mixed) > len(mixed) // 2, f"interleaved: mostly alternating, got {mixed}"
    # each client's share of its batches stays level with the others' all round long
    totals = {c: mixed.count(c) for c in clients}
    done = dict.fromkeys(clients, 0)
    for sender in mixed:
        done[sender] += 1
        shares = [done[c] / totals[c] for c in clients]
        assert max(shares) - min(shares) <= max(1 / t for t in totals.values()) + 1e-9


def test_one_worker_interleaved_is_reproducible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _senders(tmp_path / "a", monkeypatch, partition={"kind": "dirichlet", "alpha": 0.5})
    second = _senders(tmp_path / "b", monkeypatch, partition={"kind": "dirichlet", "alpha": 0.5})
    assert first == second
