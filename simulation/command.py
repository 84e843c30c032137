"""``edgesplit simulate``: every role in this process, outputs into ``--out``."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from split_models.units import format_bytes

if TYPE_CHECKING:
    from simulation.config import SimConfig

__all__ = ["simulate_command"]


def _config_path(args: argparse.Namespace) -> str | None:
    """``--config`` or the SIM.yaml named without it (not two different ones)."""
    from split_models.errors import ConfigError

    if args.config and args.config_file and args.config != args.config_file:
        raise ConfigError(f"two configs given: {args.config_file} and --config {args.config}")
    return args.config or args.config_file  # type: ignore[no-any-return]


def simulate_command(args: argparse.Namespace) -> int:
    """``edgesplit simulate``: every role in this process; outputs into ``--out``."""
    import logging
    from pathlib import Path

    from coordinator.commands import profile_cache
    from coordinator.service import RoundObserver
    from simulation.baselines import use_profile_cache
    from simulation.config import load_sim_config
    from simulation.progress import RoundProgress
    from simulation.shield import held_signals
    from simulation.simulator import simulate
    from split_models.runtime import configure_logging

    configure_logging(args.verbose)
    if not args.verbose:  # the progress display says what the log would
        logging.getLogger().setLevel(logging.WARNING)
    config = load_sim_config(_config_path(args), _overrides(args))
    use_profile_cache(profile_cache(args.profile_cache))
    out = Path(args.out)
    title, unit, fleet = _title(config)
    # a signal after the run finished waits for the outputs and the table, then ends nothing
    with _devices_hint(config), held_signals(deliver=False):
        options = {
            "password": args.broker_password,
            "allow_config_change": args.allow_config_change,
        }
        if args.quiet:
            summary = simulate(config, out, args.broker, observer=RoundObserver(), **options)
        else:
            with RoundProgress(config.training.rounds, title, unit=unit, fleet=fleet) as progress:
                summary = simulate(config, out, args.broker, observer=progress, **options)
        _print_summary(summary, out)
        _say_if_no_better(summary, config)
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    """The command line's settings over the config file's (None: not given)."""
    from coordinator.commands import parse_range, parse_shape

    return {
        "method": args.method,
        "rounds": args.rounds,
        "clients": args.clients,
        "data": args.data,
        "test_data": args.test_data,
        "model": args.model,
        "input_shape": None if args.input_shape is None else list(parse_shape(args.input_shape)),
        "num_classes": args.num_classes,
        "input_dtype": args.input_dtype,
        "input_range": parse_range(args.input_range),
        "task": args.task,
        "seed": args.seed,
        "workers": args.workers,
        "batched": args.batched,
        "deterministic": args.deterministic,
    }


def _norm_hint(config: SimConfig) -> str:
    """For a model with BatchNorm layers averaged as they are: what to try first."""
    if not _has_norm_layers(config, "average"):
        return ""
    return (
        " The model has BatchNorm layers, whose averaged running statistics fit none of the "
        'clients\' models: try `norm: recalibrate` (README, "BatchNorm").'
    )


def _say_if_no_better(summary: dict[str, Any], config: SimConfig) -> None:
    """A warning when the run ends no better than guessing, or than always answering the test
    set's most common class; a note on what the accuracy means under ``norm: local``."""
    accuracy, classes = summary["final_accuracy"], config.model.num_classes
    _say_if_at_chance(accuracy, classes, _norm_hint(config))
    _say_if_majority(accuracy, classes, summary.get("test_majority_share", 0.0))
    if _has_norm_layers(config, "local"):
        print(
            "note: with norm: local (FedBN) each client keeps its own BatchNorm layers; the "
            "accuracy above is the model with their averaged statistics, which fit none of the "
            "clients, so it understates theirs"
            + (
                ""
                if config.training.federated_eval > 0
                else ": set federated_eval (e.g. 0.1) to measure each client on its own data"
            )
        )


def _has_norm_layers(config: SimConfig, norm: str) -> bool:
    """Whether a split run (not centralized) with ``norm`` has BatchNorm layers."""
    from split_models.segment import Segment
    from split_models.weights import norm_keys

    if config.training.norm != norm or config.method == "centralized":
        return False
    model = config.model.build(seed=0)
    return bool(norm_keys(Segment.from_model(model, 0, model.num_blocks)))


def _say_if_at_chance(accuracy: object, classes: int, hint: str = "") -> None:
    """A run that ends no better than guessing did not learn: said, not left to be noticed
    in the last line (a learning rate too high for the model is the usual cause)."""
    if isinstance(accuracy, float) and accuracy <= 1 / classes + 0.05:
        print(
            f"warning: the final accuracy {accuracy:.4f} is at chance level for {classes} "
            "classes: the run did not learn (the usual causes: a learning rate too high for "
            "this model and optimizer, or too few examples or rounds for it; curves.png and "
            "rounds.csv show how it went)." + hint
        )


def _say_if_majority(accuracy: object, classes: int, majority: float) -> None:
    """A run that ends no better than always answering the test set's most common class
    (above chance when the classes are imbalanced) did not learn either: 0.9112 on a test set
    of 91 % zeros passed the chance check unremarked."""
    if not isinstance(accuracy, float) or majority <= 1 / classes + 0.05:
        return  # balanced enough: the chance check says it
    if accuracy <= majority + 0.005:
        print(
            f"warning: the final accuracy {accuracy:.4f} is no better than always answering "
            f"the most common class ({majority:.1%} of the test set): the run may have learned "
            "nothing but the class balance (accuracy alone hides it on imbalanced data; the "
            "loss in rounds.csv and a balanced test set tell more)."
        )


@contextlib.contextmanager
def _devices_hint(config: SimConfig) -> Iterator[None]:
    """A plan the simulated devices cannot hold says where their memory is set: the devices
    are the configuration's (``devices:``, defaults sized for the digits cnn), not real ones."""
    from split_models.errors import InfeasiblePlanError, ServersTooSmall

    try:
        yield
    except ServersTooSmall as error:
        raise ServersTooSmall(
            f"{error}. The simulated GPU server is SIM.yaml's gpu: section (memory "
            f"{format_bytes(config.gpu.memory)}); give it more there"
        ) from error
    except InfeasiblePlanError as error:
        profiles = ", ".join(f"{p.name} {format_bytes(p.memory)}" for p in config.fleet.devices)
        raise InfeasiblePlanError(
            f"{error}. The simulated clients are the profiles of SIM.yaml's devices: ({profiles}); "
            "give them more memory there (--config SIM.yaml with a devices: list)"
        ) from error


def _title(config: Any) -> tuple[str, str, int]:
    """The live table's title, what its devices are (clients, or hosts of clients) and how
    many there are (the rounds are counted against them)."""
    if config.method == "centralized":  # one client holding all the data
        return f"centralized: pooled data, {config.model.name}", "clients", 1
    title = f"{config.method}: {config.fleet.clients} clients, {config.model.name}"
    if not config.fleet.group_clients:
        return title, "clients", int(config.fleet.clients)
    hosts = len(config.fleet.hosts())
    return f"{title} in {hosts} hosts", "hosts", hosts


def _print_summary(summary: dict[str, object], out: object) -> None:
    rounds: list[dict[str, Any]] = summary["rounds"]  # type: ignore[assignment]
    clients: list[dict[str, Any]] = summary["clients"]  # type: ignore[assignment]
    print(f"\nsimulation {summary['run_id']} ({summary['method']}), outputs in {out}/")
    grouped = any("clients" in row for row in rounds)  # the hosts' clients, beside the hosts
    print(
        f"{'round':>5} {'accuracy':>9} {'loss':>8} {'trained':>7} "
        + (f"{'clients':>7} " if grouped else "")
        + f"{'MB up':>8} {'MB down':>8} {'wall s':>7} {'sim s':>7}"
    )
    for row in rounds:
        print(
            f"{row['round']:>5} {row['accuracy'] or 0:>9.4f} {row['loss'] or 0:>8.4f} "
            f"{row.get('participants', 0):>7} "
            + (f"{row.get('clients', 0):>7} " if grouped else "")
            + f"{row['bytes_up'] / 1e6:>8.2f} {row['bytes_down'] / 1e6:>8.2f} "
            f"{row['wall_seconds'] or 0:>7.1f} {row['simulated_seconds'] or 0:>7.2f}"
        )
    hosts: dict[str, int] = summary.get("hosts") or {}  # type: ignore[assignment]
    if clients:
        print(
            f"{'host' if hosts else 'client':<12} {'profile':<8} {'blocks':<8} {'budget':>10} "
            f"{'estimate':>10} {'measured':>10} {'cut MB up':>9} {'examples':>8}"
        )
    for client in clients:
        blocks = client["blocks"] or ["-", "-"]
        measured = client.get("measured_peak_bytes")
        print(
            f"{client['name']:<12} {client['profile']:<8} [{blocks[0]}, {blocks[1]})".ljust(31)
            + f" {format_bytes(client['budget_bytes']):>10} "
            f"{format_bytes(client['estimated_peak_bytes'] or 0):>10} "
            f"{format_bytes(measured) if measured else '-':>10} "
            f"{client.get('cut_bytes_up', 0) / 1e6:>9.2f} {client['examples']:>8}"
            + ("  does not fit its budget" if client.get("fits") is False else "")
            + (_held(hosts[client["name"]]) if client["name"] in hosts else "")
        )
    _say_idle(clients, "hosts" if hosts else "clients", summary.get("method"))
    print(
        f"final accuracy {_accuracy(summary['final_accuracy'])}, "
        f"wall {summary['total_wall_seconds']:.1f} s "
        f"(training {summary.get('training_wall_seconds', 0.0):.1f} s), "
        f"simulated {summary['total_simulated_seconds']:.1f} s on the declared devices"
    )


def _say_idle(clients: list[dict[str, Any]], kind: str, method: object) -> None:
    """A note when some of a split run's ``clients`` (or hosts) were given no blocks."""
    from simulation.config import BASELINES

    idle = [c["name"] for c in clients if not c["blocks"]]
    if idle and method not in BASELINES:
        print(
            f"note: {len(idle)} of {len(clients)} {kind} took no part: no plan gave them "
            "blocks (their memory or their data; the warnings above say why)"
        )


def _held(count: int) -> str:
    return f"  ({count:,} client{'s' if count != 1 else ''})"


def _accuracy(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"  # none: no round evaluated
