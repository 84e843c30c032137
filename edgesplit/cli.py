"""The ``edgesplit`` command: one entry point, one subcommand per task.

The environment is read here, once; each subcommand's implementation lives in its role's
package and receives plain values.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from coordinator.plan_config import CUTS, PartitionConfig
from edgesplit import __version__
from edgesplit.exits import (
    EXIT_OK,
    exit_for,
    quiet_broken_pipe,
    signals_interrupt,
    wants_traceback,
)
from edgesplit.once import refuse_repeats
from edgesplit.passwords import read_passwords
from edgesplit.runs_cli import export_parser, runs_parser
from simulation.config import BASELINES, METHODS, SimConfig
from split_models.config import MODES, TrainingConfig, default_of
from split_models.options import INPUT_DTYPE_NAMES, LOCAL_LOSSES, OPTIMIZERS, TASKS, OptimizerConfig
from split_models.runtime import configure_process
from wire.codec import ENCODINGS
from wire.topics import check_name

__all__ = ["main"]

# The model `plan` and `profile` measure when not told (a run's model has no default: RUN.yaml
# must name it). Every other default below is a configuration dataclass's.
_MODEL_SHAPE, _MODEL_CLASSES = "1,28,28", 10


def _device_name(value: str) -> str:
    """``--id``: a name the topics can carry (an argparse error otherwise, exit 2)."""
    try:
        return check_name(value, "--id")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--id: ")) from None


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape and the batch, shared by ``plan`` and ``profile``."""
    parser.add_argument(
        "--input-shape",
        default=_MODEL_SHAPE,
        help="input shape without the batch, e.g. 1,28,28 (default: %(default)s)",
    )
    parser.add_argument(
        "--num-classes", type=int, default=_MODEL_CLASSES, help="default: %(default)s"
    )
    _input_flags(parser)
    parser.add_argument(
        "--split-points",
        help="module names the model may be cut before, comma-separated (default: every legal cut)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=default_of(TrainingConfig, "batch_size"),
        help="default: %(default)s, as in RUN.yaml",
    )


def _input_flags(parser: argparse.ArgumentParser, default: str | None = "float32") -> None:
    parser.add_argument(
        "--input-dtype",
        choices=INPUT_DTYPE_NAMES,
        default=default,
        help="float32 (images, features) or int64 (token ids; give --input-range)"
        + (" (default: %(default)s)" if default else ""),
    )
    parser.add_argument(
        "--input-range", help="token ids: N (ids in [0, N)) or LOW,HIGH (ids in [LOW, HIGH))"
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="classification" if default else None,
        help="a label per sample, or language-model: the next token at every position "
        "(--num-classes is then the vocabulary)" + (" (default: %(default)s)" if default else ""),
    )


def _plan_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = commands.add_parser(
        "plan",
        help="split a model across declared devices and print the plan",
        description="Profile a model, size a segment to each device's memory and print the "
        "plan that minimises the estimated step time.",
    )
    plan.add_argument(
        "--model",
        required=True,
        help="zoo model (mlp, cnn, resnet8, resnet20...) or package.module:function",
    )
    plan.add_argument("--devices", required=True, help="devices YAML file")
    _model_arguments(plan)
    choices = (  # flag, where its default is written, choices, what it is
        ("--optimizer", default_of(OptimizerConfig, "name"), OPTIMIZERS, ""),
        ("--local-loss", default_of(TrainingConfig, "local_loss"), LOCAL_LOSSES, ""),
        (
            "--compression",
            default_of(TrainingConfig, "compression"),
            ENCODINGS,
            "precision of the streamed activations; ",
        ),
        ("--cuts", default_of(PartitionConfig, "cuts"), CUTS, "one cut per edge, or uniform; "),
        ("--mode", default_of(TrainingConfig, "mode"), MODES, "backprop is splitfed's; "),
    )
    for flag, default, options, what in choices:
        plan.add_argument(
            flag, default=default, choices=options, help=f"{what}default: %(default)s"
        )
    plan.add_argument(
        "--min-edge-blocks",
        type=int,
        default=default_of(PartitionConfig, "min_edge_blocks"),
        help="blocks every edge keeps, so raw data never leaves it (default: %(default)s)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _profile_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    profile = commands.add_parser(
        "profile",
        help="profile a model's blocks (memory, activations, FLOPs)",
        description="Measure every block of a model for training at a batch size.",
    )
    profile.add_argument("--model", required=True, help="zoo model or package.module:function")
    _model_arguments(profile)
    profile.add_argument(
        "--local-loss",
        action="append",
        choices=LOCAL_LOSSES,
        help="heads to profile (repeatable; default: all)",
    )
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")


def _broker_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    broker = commands.add_parser(
        "broker",
        help="run a mosquitto broker for development (foreground, loopback)",
        description="Run mosquitto in the foreground on 127.0.0.1 with a configuration fit "
        "for edgesplit (MQTT v5, large packets, no QoS 1 drops). Ctrl-C stops it.",
    )
    broker.add_argument("--port", type=int, default=1883, help="default: %(default)s")


def _broker_flags(parser: argparse.ArgumentParser) -> None:
    """``--broker`` (a deployment's broker URL) and the file with the account's password."""
    parser.add_argument(
        "--broker",
        default="mqtt://127.0.0.1:1883",
        help="MQTT broker URL, mqtt://[ACCOUNT@]host:port or mqtts://...?ca=FILE (TLS); the "
        "account's password from --broker-password-file, EDGESPLIT_BROKER_PASSWORD or "
        "EDGESPLIT_BROKER_PASSWORD_FILE, never on the command line (default: %(default)s)",
    )
    _broker_password_flag(parser)


def _broker_password_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker-password-file",
        metavar="PATH",
        help="file whose first line is the broker account's password (mode 0600)",
    )


def _db_flags(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--db`` and the file with its password (PostgreSQL URLs that name only the user)."""
    parser.add_argument(
        "--db",
        required=default is None,
        default=default,
        help="database URL or SQLite file, e.g. runs.db or postgresql+psycopg://USER@host/db"
        + (" (default: %(default)s)" if default else ""),
    )
    parser.add_argument(
        "--db-password-file",
        metavar="PATH",
        help="file whose first line is the database password (else EDGESPLIT_DB_PASSWORD or "
        "EDGESPLIT_DB_PASSWORD_FILE)",
    )
    parser.add_argument(
        "--checkpoints",
        metavar="DIR",
        help="checkpoint folder (default: the one the database records, else DB.checkpoints/ "
        "beside a SQLite file; required once for PostgreSQL, which then records it)",
    )


def _coordinator_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    coordinator = commands.add_parser(
        "coordinator",
        help="run or resume a training run over MQTT",
        description="Create the run (or resume it from its last committed round), wait for "
        "the declared devices, plan, train every round and commit it to the store.",
    )
    coordinator.add_argument("--config", required=True, help="run configuration (RUN.yaml)")
    _db_flags(coordinator, default="edgesplit.db")
    _broker_flags(coordinator)
    coordinator.add_argument(
        "--max-attempts", type=int, default=3, help="tries per round (default: %(default)s)"
    )
    _profile_cache_flag(coordinator)
    coordinator.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run whose training settings changed (recorded as a run event); "
        "without it such a resume is refused, naming the keys",
    )
    coordinator.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="how long the run stays this coordinator's after its last sign of life; another "
        "coordinator takes it over after that (default: %(default)s)",
    )
    coordinator.add_argument(
        "--db-outage-wait",
        type=float,
        metavar="SECONDS",
        help="how long to wait for a database server that does not answer (a restart, a "
        "failover; at start too) before exiting 3; the round under way goes on meanwhile "
        "(default: 120, storage/outage.py; 0 gives up at once)",
    )
    coordinator.add_argument("-v", "--verbose", action="store_true")


def _profile_cache_flag(parser: argparse.ArgumentParser) -> None:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cache = os.environ.get("EDGESPLIT_PROFILE_CACHE") or os.path.join(cache, "edgesplit/profiles")
    parser.add_argument(
        "--profile-cache",
        metavar="DIR",
        default=cache,
        help="folder keeping model profiles: a model is measured once per host and version "
        "(default: %(default)s, or EDGESPLIT_PROFILE_CACHE; 'none' measures every time)",
    )


def _allowed_models(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        dest="models",
        help="an import path (package.module:function) of a model this device may train, "
        "besides the zoo's; repeat for more. A task naming any other model is refused: no "
        "message makes the device import code",
    )


def _role_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _coordinator_parser(commands)
    edge = commands.add_parser(
        "edge",
        help="run an edge agent: train assigned front blocks on local data",
        description="Announce this device's capabilities and train the blocks each round "
        "assigns, streaming the cut activations to the GPU servers. Runs until stopped.",
    )
    edge.add_argument(
        "--id", required=True, type=_device_name, help="device name (stable across restarts)"
    )
    _broker_flags(edge)
    edge.add_argument("--data", required=True, help="local training data, e.g. npz:PATH")
    edge.add_argument(
        "--memory", default="512MiB", help="memory for training (default: %(default)s)"
    )
    edge.add_argument("--flops", default="auto", help="FLOP/s, or auto: measured (default)")
    edge.add_argument("--uplink", default="20Mbit", help="uplink bandwidth (default: %(default)s)")
    _allowed_models(edge)
    edge.add_argument("-v", "--verbose", action="store_true")
    gpu = commands.add_parser(
        "gpu-server",
        help="run a GPU server agent: train the back blocks on the edges' streams",
        description="Announce this server and train the back blocks of each round on the "
        "activation streams of the edges. Runs until stopped.",
    )
    gpu.add_argument(
        "--id", required=True, type=_device_name, help="server name (stable across restarts)"
    )
    _broker_flags(gpu)
    gpu.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    gpu.add_argument("--memory", default="80GiB", help="memory for training (default: %(default)s)")
    gpu.add_argument(
        "--flops", default="auto", help="sustained FLOP/s, or auto: measured on a CPU, 1e13 else"
    )
    _allowed_models(gpu)
    gpu.add_argument("-v", "--verbose", action="store_true")


def _simulate_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim = commands.add_parser(
        "simulate",
        help="run the coordinator, a GPU server and N clients in this process",
        description="A whole edgesplit run on one machine, on the deployment's code paths. "
        "Without --config it runs the embedded defaults on scikit-learn's bundled digits.",
    )
    sim.add_argument("--config", help="simulation config (SIM.yaml); defaults when omitted")
    sim.add_argument("config_file", nargs="?", metavar="SIM.yaml", help="the same as --config")
    sim.add_argument("--out", default="sim-out", help="output directory (default: %(default)s)")
    # No defaults here: a flag given wins over SIM.yaml, which wins over SimConfig's defaults.
    defaults = SimConfig()
    sim.add_argument(
        "--method",
        choices=(*METHODS, *BASELINES),
        help=f"default: the config's, else {defaults.method}",
    )
    sim.add_argument(
        "--broker",
        default="none",
        help="none (in-process, default), embedded (a private mosquitto) or mqtt://host:port",
    )
    _broker_password_flag(sim)
    sim.add_argument(
        "--rounds", type=int, help=f"default: the config's, else {defaults.training.rounds}"
    )
    sim.add_argument(
        "--clients", type=int, help=f"default: the config's, else {defaults.fleet.clients}"
    )
    sim.add_argument(
        "--data",
        help=f"training data: npz:PATH, digits, ... (default: the config's, else "
        f"{defaults.data.data})",
    )
    sim.add_argument("--test-data", help="held-out data (else test_fraction of --data)")
    sim.add_argument(
        "--model",
        help=f"zoo model or package.module:function (default: the config's, else "
        f"{defaults.model.name})",
    )
    sim.add_argument("--input-shape", help="e.g. 3,32,32 (default: the config's, else 1,8,8)")
    sim.add_argument("--num-classes", type=int, help="default: the config's")
    _input_flags(sim, default=None)
    sim.add_argument(
        "--seed", type=int, help=f"default: the config's, else {defaults.training.seed}"
    )
    _simulate_host_flags(sim)
    _simulate_run_flags(sim)


def _simulate_run_flags(sim: argparse.ArgumentParser) -> None:
    """Which run it goes on with, and what it shows."""
    _profile_cache_flag(sim)
    sim.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume the cancelled run in --out though its training settings changed (an event)",
    )
    sim.add_argument("-q", "--quiet", action="store_true", help="only the result table")
    sim.add_argument("-v", "--verbose", action="store_true", help="log every step")


def _simulate_host_flags(sim: argparse.ArgumentParser) -> None:
    """How the simulation host trains its clients."""
    sim.add_argument(
        "--workers", type=int, help="clients training at once (default: one per CPU core)"
    )
    sim.add_argument(
        "--batched",
        action="store_true",
        default=None,
        help="train clients of the same cut together, one vmapped step (see simulation.stack)",
    )
    sim.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="the GPU server trains the clients' batches client by client: same seed, same "
        "weights, bit for bit",
    )


def _store_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = commands.add_parser(
        "status",
        help="list runs, or one run's rounds and metrics",
        description="Show runs stored in a database (SQLite file or PostgreSQL URL).",
    )
    _db_flags(status)
    status.add_argument("--run", help="show this run's rounds")
    status.add_argument("--json", action="store_true", help="print JSON")
    database = commands.add_parser("db", help="database maintenance")
    actions = database.add_subparsers(dest="action", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="create or migrate the schema to the latest")
    _db_flags(upgrade)
    check = actions.add_parser(
        "check", help="verify every checkpoint's hash and say which rounds are usable"
    )
    _db_flags(check)
    gc = actions.add_parser("gc", help="delete orphaned checkpoint files and abandoned .tmp files")
    _db_flags(gc)
    gc.add_argument(
        "--min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="spare files younger than this: a running coordinator's commit may own them "
        "(default: %(default)s; 0 when no coordinator uses the store)",
    )
    runs_parser(commands, _db_flags)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgesplit",
        description="Train neural networks across heterogeneous edge devices and GPU servers.",
    )
    parser.add_argument("--version", action="version", version=f"edgesplit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _plan_parser(commands)
    _profile_parser(commands)
    _broker_parser(commands)
    _role_parsers(commands)
    _simulate_parser(commands)
    export_parser(commands, _db_flags)
    _store_parsers(commands)
    refuse_repeats(parser)
    return parser


_NETWORKED = frozenset({"coordinator", "edge", "gpu-server", "simulate", "broker"})
# Commands that only read or change a store: they start without loading torch (0.2 s, not 2 s).
_STORE_ONLY = frozenset({"status", "runs", "db", "broker"})

# Each subcommand's implementation, imported only when it runs (the roles stay apart and
# `edgesplit status` does not load torch's training stack).
_COMMANDS = {
    "plan": "coordinator.commands:plan_command",
    "profile": "coordinator.commands:profile_command",
    "coordinator": "coordinator.commands:coordinator_command",
    "simulate": "simulation.command:simulate_command",
    "edge": "edge_client.command:edge_command",
    "gpu-server": "gpu_server.command:gpu_server_command",
    "export": "coordinator.store_commands:export_command",
    "status": "coordinator.store_commands:status_command",
    "db": "coordinator.db_commands:db_command",
    "runs": "coordinator.run_commands:runs_command",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a failure is one line on stderr and an exit code
    (:mod:`edgesplit.exits`). SIGTERM and SIGHUP interrupt like Ctrl-C, so a run in progress is
    marked cancelled and every process it started is stopped."""
    args = build_parser().parse_args(argv)
    configure_process(torch_too=args.command not in _STORE_ONLY)
    try:
        with quiet_broken_pipe(args.command not in _NETWORKED), signals_interrupt():
            if args.command == "broker":
                return _run_broker(args.port)
            read_passwords(args)
            module, _, function = _COMMANDS[args.command].partition(":")
            command: Callable[[argparse.Namespace], int] = getattr(
                importlib.import_module(module), function
            )
            return command(args)
    except (Exception, KeyboardInterrupt) as error:
        verbose = wants_traceback(os.environ, getattr(args, "verbose", False))
        code = exit_for(args.command, error, verbose)
        if isinstance(error, KeyboardInterrupt):
            # the run is cancelled and stored; a worker thread still inside torch while the
            # interpreter finalizes aborts it (SIGABRT, 'terminate called...'): leave now
            sys.stdout.flush()
            os._exit(code)
        return code


def _run_broker(port: int) -> int:
    """mosquitto in the foreground until it exits or a signal comes (SIGINT, SIGTERM, SIGHUP:
    exit 0); it and its folder are gone on every way out."""
    from wire.broker import Broker

    broker = Broker(port=port)
    try:
        broker.start()
        print(
            f"mosquitto listening on {broker.url} (config {broker.config_path}); Ctrl-C stops it",
            flush=True,
        )
        return broker.wait()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        broker.close()


if __name__ == "__main__":
    raise SystemExit(main())
