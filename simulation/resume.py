"""Which run a simulation goes on with. The same command run again resumes the latest
cancelled run in ``--out`` that trains as it would: the same run settings (rounds may
differ), and the same data, partition and devices, which the run config does not hold; the
simulation records their digests as a ``simulation`` event when it starts a run. A resume
that would end before the rounds already committed is refused by name. A finished run is
gone on with the same way when more rounds are asked for than it has (``--rounds`` raised:
it trains the rounds it lacks); asked for no more, a new run starts."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import (
    STRUCTURE_KEYS,
    TRAINING_KEYS,
    RunConfig,
    config_changes,
    describe_changes,
)
from coordinator.resumption import code_change, create_or_check, model_code, stored_code
from coordinator.stopping import mark_cancelled
from simulation.config import Profile, SimConfig, run_config
from split_models.data import Dataset
from split_models.errors import ConfigError
from storage import open_store
from storage.base import RunStore
from storage.errors import NotFoundError
from storage.records import Event, RunRecord

log = logging.getLogger(__name__)

RECORD = "simulation"  # the event that holds a run's digests
# settings that change which tensors a run holds (its local heads): never resumed across
_HELD_TENSORS = ("local_loss", "mode")


def fingerprint(
    train: Dataset, parts: Sequence[np.ndarray], profiles: Mapping[str, Profile]
) -> dict[str, str]:
    """Digests of what a simulated run trains on and with: the training data, each client's
    share of it (so the number of clients, the partition and its seed), the devices."""

    def digest(*chunks: bytes) -> str:
        hashed = hashlib.sha256()
        for chunk in chunks:
            hashed.update(len(chunk).to_bytes(8, "little") + chunk)
        return hashed.hexdigest()[:16]

    arrays = (np.ascontiguousarray(train.x), np.ascontiguousarray(train.y))
    layout = json.dumps([[a.dtype.str, list(a.shape)] for a in arrays]).encode()
    devices = [[name, p.name, p.memory, p.flops, p.uplink] for name, p in profiles.items()]
    return {
        "data": digest(layout, *(a.tobytes() for a in arrays)),
        "partition": digest(*(np.asarray(p, dtype=np.int64).tobytes() for p in parts)),
        "devices": digest(json.dumps(devices).encode()),
    }


def start_run(store: RunStore, run: RunConfig, prints: Mapping[str, str]) -> None:
    """Create ``run`` (unless it is resumed) with its digests, for a later resume to check."""
    try:
        store.get_run(run.run_id)
    except NotFoundError:
        create_or_check(store, run, allow_config_change=False)
        store.add_event(run.run_id, Event(RECORD, json.dumps(dict(prints), sort_keys=True)))


@contextlib.contextmanager
def started_run(store: RunStore, run: RunConfig, prints: Mapping[str, str]) -> Iterator[None]:
    """:func:`start_run`; a stop (Ctrl-C, a signal) within the block, before the coordinator
    watches the run, leaves it ``cancelled`` with an event (it stayed ``created`` for good)."""
    start_run(store, run, prints)
    try:
        yield
    except KeyboardInterrupt as stop:
        mark_cancelled(store, run.run_id, f"interrupted ({stop or 'SIGINT'})")
        raise


def _recorded(store: RunStore, run_id: str) -> dict[str, str] | None:
    for event in store.events(run_id):
        if event.kind == RECORD:
            try:
                loaded = json.loads(event.detail)
            except ValueError:
                return None
            return loaded if isinstance(loaded, dict) else None
    return None  # a run from before the digests were recorded: not checked


def _grouped(stored: Mapping[str, Any]) -> bool:
    """Whether a stored run's edges were hosts of grouped clients (simulation.hosts)."""
    devices = stored.get("devices")
    edges = devices.get("edges", []) if isinstance(devices, Mapping) else []
    return any(str(e).startswith("host-") for e in edges)


def resumable_run(
    config: SimConfig,
    out: Path,
    test_data: str,
    prints: Mapping[str, str],
    allow_config_change: bool = False,
) -> str | None:
    """The latest run in ``out`` to go on with (cancelled, or finished with fewer rounds than
    ``config`` asks for) that trains as ``config`` does on the data, partition and devices of
    ``prints``; None (with a warning naming why the latest was passed over) when there is
    none. ``allow_config_change``: a run whose training settings (not its network, data,
    partition or devices) differ is gone on with too; the coordinator records the change."""
    wanted = config.training.rounds
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        listed = _take_up_orphans(store)
        runs = sorted(
            (r for r in listed if r.status == "cancelled" or _shorter(r, wanted)),
            key=lambda r: r.updated_at,
            reverse=True,
        )
        _hint_orphans([r.run_id for r in listed if r.status == "training"], out)
        passed: tuple[str, str, bool] | None = None  # the latest run not resumed, why, hint
        for run in runs:
            reasons, differ = _differences(store, run, config, test_data, prints)
            if differ is None or (differ == "settings" and allow_config_change):
                _check_rounds(run.run_id, run.current_round or 0, wanted)
                if run.status == "finished":
                    log.warning(
                        "run %s in this --out finished with %d round(s) committed: it goes on "
                        "to round %d (another --out starts a new run)",
                        run.run_id,
                        run.current_round or 0,
                        wanted,
                    )
                return run.run_id
            settings_only = differ == "settings"
            passed = passed or (f"{run.status} run {run.run_id}", reasons, settings_only)
    if passed is None:
        _say_if_new_beside(listed, wanted)
    if passed is not None:
        latest, reason, settings_only = passed
        hint = " (--allow-config-change resumes it with these settings)" if settings_only else ""
        log.warning(
            "not resuming %s, which trained otherwise (%s): starting a new run%s",
            latest,
            reason,
            hint,
        )
    return None


def run_id_for(
    config: SimConfig,
    out: Path,
    test_data: str,
    prints: Mapping[str, str] | None,
    allow_config_change: bool = False,
) -> str:
    """The run in ``out`` to go on with (:func:`resumable_run`; ``prints`` None: a baseline,
    never resumed); else a new id."""
    resumed = None
    if prints is not None and (out / "runs.db").exists():
        resumed = resumable_run(config, out, test_data, prints, allow_config_change)
    return resumed or f"sim-{uuid.uuid4().hex[:8]}"


def _differences(
    store: RunStore,
    run: RunRecord,
    config: SimConfig,
    test_data: str,
    prints: Mapping[str, str],
) -> tuple[str, str | None]:
    """How ``run`` trained otherwise than ``config`` would, in words, and what differs: None
    (nothing), "settings" (only its training settings) or "other" (its network, data,
    partition or devices)."""
    now = run_config(config, run.run_id, test_data)
    network = config_changes(run.config, now, STRUCTURE_KEYS)
    settings = config_changes(run.config, now, TRAINING_KEYS)
    recorded = _recorded(store, run.run_id) or {}
    other = [k for k in prints if k in recorded and recorded[k] != prints[k]]
    # model code changed: a settings change (a new run, or --allow-config-change goes on):
    # it was an error telling `simulate` to "use a new run_id", which it has no flag for
    code = code_change(stored_code(store, run.run_id), model_code(now)) if not network else None
    reasons = [describe_changes({**network, **settings}), ", ".join(f"other {k}" for k in other)]
    reasons.append(code or "")
    grouped = (was := _grouped(run.config)) != config.fleet.group_clients  # its devices
    if grouped:
        reasons = [f"group_clients {str(was).lower()} -> {str(not was).lower()}"]
    differ = "other" if network or other else "settings" if settings or code else None
    if differ == "settings" and (grouped or set(settings) & set(_HELD_TENSORS)):
        differ = "other"
    return "; ".join(filter(None, reasons)), differ


def _shorter(run: RunRecord, rounds: int) -> bool:
    """Whether ``run`` finished with fewer rounds committed than ``rounds``."""
    return run.status == "finished" and (run.current_round or 0) < rounds


def _say_if_new_beside(listed: Sequence[RunRecord], wanted: int) -> None:
    """A new run where one already finished with ``wanted`` rounds or more: said, since its
    outputs replace that run's in the folder (it was silent)."""
    done = [r for r in listed if r.status == "finished" and not _shorter(r, wanted)]
    if done:
        latest = max(done, key=lambda r: r.updated_at)
        log.warning(
            "run %s in this --out finished with %d round(s), no fewer than %d: starting a new "
            "run, whose outputs here replace its own (it stays in runs.db; another --out "
            "keeps both)",
            latest.run_id,
            latest.current_round or 0,
            wanted,
        )


def _take_up_orphans(store: RunStore) -> list[RunRecord]:
    """The runs in the store, those left ``training`` by a process that is gone (killed on
    this host, or silent past its lease) marked cancelled first, so that they resume: a
    `kill -9` needed `edgesplit runs stop` before the same command went on with the run."""
    for run in store.list_runs():
        lease = store.lease(run.run_id) if run.status == "training" else None
        if lease is not None and lease.gone():
            why = f"its process is gone ({lease.describe()}); taken up by a new simulate"
            mark_cancelled(store, run.run_id, why)
            log.warning("run %s in this --out was left training: %s", run.run_id, why)
    return store.list_runs()


def _hint_orphans(training: Sequence[str], out: Path) -> None:
    """Runs still marked training in ``out`` when a simulation starts there: their process was
    killed (or another simulation still runs there); say how to resume them."""
    for run_id in training:
        log.warning(
            "run %s in this --out is still marked training: if its process was killed, "
            "`edgesplit runs stop %s --db %s` marks it cancelled and this command then "
            "resumes it; starting a new run",
            run_id,
            run_id,
            out / "runs.db",
        )


def _check_rounds(run_id: str, committed: int, rounds: int) -> None:
    if committed > rounds:
        raise ConfigError(
            f"rounds: cancelled run {run_id} in this --out has {committed} rounds committed "
            f"and {rounds} would end before them; resume it with --rounds {committed} or more "
            f"({committed} ends it with the rounds it has), or give another --out for a new run"
        )
