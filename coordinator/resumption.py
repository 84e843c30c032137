"""A run's start: create it or check it against its stored config, and pick up where an
earlier coordinator of it stopped (its last good round, the numbers of its tries)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from coordinator.config import (
    STRUCTURE_KEYS,
    TRAINING_KEYS,
    RunConfig,
    config_changes,
    describe_changes,
)
from coordinator.lease import RunLease
from split_models.errors import ConfigError
from split_models.fingerprint import (
    changed_blocks,
    describe_blocks,
    model_fingerprint,
    parse_fingerprint,
)
from storage.base import RunStore
from storage.errors import NotFoundError
from storage.records import Event, ResumeState

__all__ = [
    "MODEL_CODE",
    "code_change",
    "create_or_check",
    "first_try",
    "model_code",
    "record_take_over",
    "resume_state",
    "stored_code",
]

log = logging.getLogger(__name__)
MODEL_CODE = "model-code"  # the event holding the fingerprint of the model trained
_MAX_FIRST_TRY = 900  # devices take tries up to 999; the round's own tries come after it


def create_or_check(store: RunStore, config: RunConfig, allow_config_change: bool) -> None:
    """Create the run, or check that the stored one trains the same model (and the same way,
    unless ``allow_config_change``); one that committed no round starts over with ``config``."""
    try:
        run = store.get_run(config.run_id)
    except NotFoundError:
        code = model_code(config)  # a model that does not build leaves no run behind
        store.create_run(config.run_id, config.to_dict(), config.training.seed)
        _record_code(store, config.run_id, code)
        return
    if run.current_round:
        _check_changes(store, config, run.config, allow_config_change)
    else:
        _start_over(store, config, run.config)
    if run.config != config.to_dict():  # also rounds, deadline, devices: allowed
        store.set_run_config(config.run_id, config.to_dict())
    if run.status == "created":  # created before (a simulation's digests), never started
        return
    log.info("resuming run %s after round %s", config.run_id, run.current_round or 0)
    store.add_event(
        config.run_id, Event("resumed", f"after round {run.current_round or 0} ({run.status})")
    )


def _check_changes(
    store: RunStore, config: RunConfig, stored: dict[str, Any], allow_config_change: bool
) -> None:
    """A run that trained rounds goes on with the same network, and with the same training
    settings and model code unless ``allow_config_change`` (then the change is recorded)."""
    structure = config_changes(stored, config, STRUCTURE_KEYS)
    if structure:
        raise ConfigError(
            f"run {config.run_id!r} exists with another network: "
            f"{describe_changes(structure)} (use a new run_id)"
        )
    changes = config_changes(stored, config, TRAINING_KEYS)
    if changes and not allow_config_change:
        raise ConfigError(
            f"run {config.run_id!r} was trained with other settings: "
            f"{describe_changes(changes)}; resume with the stored ones, use a new "
            "run_id, or pass --allow-config-change to train on with these"
        )
    if changes:
        log.warning("run %s changes its config: %s", config.run_id, describe_changes(changes))
        store.add_event(config.run_id, Event("config-changed", describe_changes(changes)))
    _check_code(store, config, allow_config_change)


def _start_over(store: RunStore, config: RunConfig, stored: dict[str, Any]) -> None:
    """A run that committed no round (its start failed, or it was stopped in round 1) has
    trained nothing with its old settings: it starts over with these, whatever changed, and
    the change is recorded."""
    changes = config_changes(stored, config, (*STRUCTURE_KEYS, *TRAINING_KEYS))
    current = model_code(config)
    if changes or code_change(stored_code(store, config.run_id), current):
        what = describe_changes(changes) or "the model's code"
        log.info("run %s committed no round: it starts over with %s", config.run_id, what)
        store.add_event(
            config.run_id, Event("config-changed", f"{what} (no round had been committed)")
        )
        _record_code(store, config.run_id, current)


def model_code(config: RunConfig) -> list[str]:
    """The fingerprint of the model ``config`` builds (:mod:`split_models.fingerprint`)."""
    return model_fingerprint(config.model.build(seed=config.training.seed).blocks)


def stored_code(store: RunStore, run_id: str, until: datetime | None = None) -> list[str] | None:
    """The fingerprint of the model code the run last trained with (``until``: as of then, a
    round's commit); None for a run from before fingerprints."""
    for event in reversed(store.events(run_id)):
        if event.kind != MODEL_CODE or (until and event.at and event.at > until):
            continue
        if (blocks := parse_fingerprint(event.detail)) is not None:
            return blocks
    return None


def code_change(stored: list[str] | None, current: list[str]) -> str | None:
    """How ``current`` differs from ``stored`` in words; None when it does not (or nothing
    was stored)."""
    if stored is None or not (changed := changed_blocks(stored, current)):
        return None
    return f"the model's code changed in {describe_blocks(changed)} (layers or their source)"


def _record_code(store: RunStore, run_id: str, blocks: list[str]) -> None:
    store.add_event(run_id, Event(MODEL_CODE, json.dumps({"blocks": blocks})))


def _check_code(store: RunStore, config: RunConfig, allow_config_change: bool) -> None:
    """Refuse to resume with model code that computes something else than the run's weights
    were trained for (unless ``allow_config_change``: then it is recorded)."""
    stored, current = stored_code(store, config.run_id), model_code(config)
    if stored is None:  # trained before fingerprints: from now on, this code
        _record_code(store, config.run_id, current)
        return
    if (what := code_change(stored, current)) is None:
        return
    if not allow_config_change:
        raise ConfigError(
            f"run {config.run_id!r} was trained with other model code: {what}; resume with "
            "the code it was trained with, use a new run_id, or pass --allow-config-change "
            "to train on with this code"
        )
    log.warning("run %s: %s; training on with it", config.run_id, what)
    store.add_event(config.run_id, Event("config-changed", what))
    _record_code(store, config.run_id, current)


def first_try(store: RunStore, run_id: str, number: int) -> int:
    """The number round ``number``'s first try takes in this process: above any an earlier
    coordinator of the run gave it (1 for a round no coordinator opened yet). Devices tell a
    round's tries apart by number (credits, batches); a restarted coordinator numbering from
    1 again made the GPU server's credits for "try 1" reach edges still in the old try 1,
    whose restart then dropped them: each resume lost a whole round deadline. An earlier
    coordinator's tries of the round ended in an event of the round (failed, an outage)
    or were cut short by its end (one ``resumed`` event each), so their count bounds them."""
    events = store.events(run_id)
    if not any(e.round == number for e in events) and not _opened(store, run_id, number):
        return 1
    earlier = sum(e.round == number for e in events) + sum(e.kind == "resumed" for e in events)
    return min(1 + earlier, _MAX_FIRST_TRY)


def _opened(store: RunStore, run_id: str, number: int) -> bool:
    try:
        store.get_round(run_id, number)
    except NotFoundError:
        return False
    return True


def resume_state(store: RunStore, run_id: str) -> ResumeState | None:
    """The run's last committed round whose checkpoint verifies (None: none committed); the
    console says so when later rounds' checkpoints did not and are trained again."""
    recorded = store.get_run(run_id).current_round or 0
    resumed = store.resume(run_id)
    done = 0 if resumed is None else resumed.round.number
    if done < recorded:
        rounds = f"round {recorded}" if done + 1 == recorded else f"rounds {done + 1}-{recorded}"
        log.warning(
            "the checkpoint of %s is unusable (events: checkpoint-corrupt); resuming from "
            "round %d and training again",
            rounds,
            done,
        )
    return resumed


def record_take_over(store: RunStore, lease: RunLease) -> None:
    """An event of the run when ``lease`` was taken over from a coordinator gone."""
    if lease.replaced is not None:
        detail = f"from a coordinator gone ({lease.replaced.describe()})"
        store.add_event(lease.run_id, Event("lease-taken-over", detail))
