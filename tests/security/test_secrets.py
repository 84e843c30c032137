"""Issue 16, no secret anywhere it can leak: a whole deployment on the production broker (TLS,
an account per device made with add-device.sh, the shipped ACL and plugin) and a store whose
user has a password, each password given in a 0600 file. While it runs, every process's argv
(world-readable in /proc) is read; afterwards every log line, every file the deployment wrote
(bytes), the output of the store commands and of commands that fail on a URL holding a password
are searched for every password. The store and its checkpoints are the owner's alone."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from split_models.runtime import RUNTIME_ENV
from tests.e2e.cli import ROOT
from tests.e2e.deployment import Deployment
from tests.security.conftest import ProductionBroker
from wire.broker import free_port

pytestmark = pytest.mark.e2e


class _ArgvWatch(threading.Thread):
    """Reads the command line of every process on the machine every 20 ms; remembers the pids
    read and any command line holding a secret."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__(daemon=True)
        self._secrets = [s.encode() for s in secrets]
        self._halt = threading.Event()
        self.seen: set[int] = set()
        self.leaks: set[str] = set()
        self.scans = 0

    def scan(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes()
            except OSError:  # ended meanwhile
                continue
            self.seen.add(int(entry.name))
            if any(secret in argv for secret in self._secrets):
                self.leaks.add(argv.replace(b"\0", b" ").decode(errors="replace"))
        self.scans += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.scan()
            self._halt.wait(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _secret_file(directory: Path, name: str, password: str) -> str:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / name
    path.write_text(f"{password}\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str | None]]:
    """The deployment's store as (URL naming only its user, that user's password): PostgreSQL
    with a role of its own when the tests have one (EDGESPLIT_TEST_POSTGRES_URL, as in CI),
    else SQLite (no password; the database commands are checked on PostgreSQL URLs below)."""
    if not os.environ.get("EDGESPLIT_TEST_POSTGRES_URL"):
        yield f"sqlite:///{tmp_path / 'deployment' / 'runs.db'}", None
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin_url = make_url(request.getfixturevalue("postgres_url"))
    role, password = f"edgesplit_{uuid.uuid4().hex[:8]}", secrets.token_urlsafe(12)
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:  # token_urlsafe: only [A-Za-z0-9_-], safe to quote
        connection.execute(text(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'"))
        connection.execute(text(f'ALTER DATABASE "{admin_url.database}" OWNER TO "{role}"'))
    try:
        yield admin_url.set(username=role, password=None).render_as_string(), password
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'REASSIGN OWNED BY "{role}" TO CURRENT_USER'))
            connection.execute(text(f'DROP OWNED BY "{role}"'))
            connection.execute(text(f'DROP ROLE "{role}"'))
        admin.dispose()


def _edgesplit(
    directory: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``edgesplit ARGS`` as an operator runs it, with ``env`` added to the environment."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "edgesplit", *args],
        capture_output=True,
        text=True,
        cwd=directory,
        env={**os.environ, **RUNTIME_ENV, "PYTHONPATH": path, **(env or {})},
        timeout=timeout,
    )


def _files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        yield from (p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _start_gpu_with_flag(
    deployment: Deployment, production: ProductionBroker, password_file: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """A second GPU server given its password with ``--broker-password-file``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    log = deployment.directory / "gpu-b.log"
    with log.open("ab") as output:
        broker = ["--broker", production.url("gpu"), "--broker-password-file", password_file]
        process = subprocess.Popen(
            [sys.executable, "-m", "edgesplit", "gpu-server", "--id", "gpu-b", *broker],
            cwd=deployment.directory,
            env={**os.environ, **RUNTIME_ENV, "PYTHONPATH": path},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return process, log


def _wait_online(process: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while "online" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"gpu-b did not come online: {log.read_text(errors='replace')}")
        time.sleep(0.1)


def _failing_commands(directory: Path, secret: str) -> list[subprocess.CompletedProcess[str]]:
    """Commands refused because of a URL that holds ``secret`` (an operator's typo)."""
    closed = free_port()  # nothing listens there
    unreachable = f"postgresql+psycopg://edgesplit:{secret}@127.0.0.1:{closed}/runs"
    edge = ("edge", "--id", "pi-01", "--data", "digits", "--broker")
    return [
        _edgesplit(directory, *edge, f"mqtts://pi-01:{secret}@127.0.0.1:notaport?ca=x"),
        _edgesplit(directory, *edge, f"tcp://pi-01:{secret}@127.0.0.1:{closed}"),
        _edgesplit(directory, "status", "--db", unreachable),
        _edgesplit(directory, "db", "upgrade", "--db", unreachable),
        _edgesplit(directory, "export", "--db", unreachable, "--out", "onnx-none"),
    ]


def test_no_password_in_any_argv_log_output_or_file(
    production_broker: ProductionBroker,
    production_files: dict[str, object],
    store: tuple[str, str | None],
    tmp_path: Path,
) -> None:
    # prepare: every account's password in a 0600 file of its own, outside the deployment
    production = production_broker
    db_url, db_secret = store
    vault, directory = tmp_path / "vault", tmp_path / "deployment"
    directory.mkdir()
    files = {a: _secret_file(vault, a, p) for a, p in production.passwords.items()}
    db_file = _secret_file(vault, "db", db_secret) if db_secret else None
    typo_secret = secrets.token_urlsafe(12)  # only ever typed into a URL of a failing command
    every_secret = [*production.passwords.values(), *([db_secret] if db_secret else [])]

    def env_for(account: str) -> dict[str, str]:
        env = {"EDGESPLIT_BROKER_PASSWORD_FILE": files[account]}
        if account == "coordinator" and db_file:
            env["EDGESPLIT_DB_PASSWORD_FILE"] = db_file
        return env

    deployment = Deployment(
        "", db_url, directory, rounds=2, url_for=production.url, env_for=env_for
    )
    watch = _ArgvWatch(every_secret)

    # execute: the run and the store commands an operator runs, every argv watched; then
    # commands given a password inside a URL (on their argv, as the operator typed it)
    ran = _operate(deployment, production, watch, (files["gpu"], db_file, db_secret))
    failures = _failing_commands(directory, typo_secret)

    # assert: every command did what it should, and no secret is anywhere
    outputs = _outputs_checked(ran, failures, db_secret)
    roles = {name: process.pid for name, process in deployment.processes.items()}
    assert set(roles.values()) | {ran.gpu_b} <= watch.seen, "every role's argv was read"
    assert watch.scans > 10 and not watch.leaks, watch.leaks
    for output in outputs:
        for secret in (*every_secret, typo_secret):
            assert secret not in output, output
    # every file the roles and commands wrote, and the broker's (persistence, its log if any)
    written = list(_files(directory, production.broker.directory))
    assert len(list(directory.glob("*.log"))) == len(roles) + 1  # one per role process
    password_file = Path(str(production_files["dir"])) / "passwords"  # the broker's: hashes
    _assert_no_secret_in([*written, password_file], [*every_secret, typo_secret])
    assert _mode(password_file) == 0o600
    _assert_owner_only(db_url, db_secret, directory)


def _assert_no_secret_in(paths: list[Path], secrets_: list[str]) -> None:
    assert any(p.suffix == ".safetensors" for p in paths), "the checkpoints were searched"
    for path in paths:
        content = path.read_bytes()
        for secret in secrets_:
            assert secret.encode() not in content, f"{path} holds a password"


@dataclass
class _Ran:
    """What the operator's commands printed, and the second GPU server's pid."""

    status: subprocess.CompletedProcess[str]
    export: subprocess.CompletedProcess[str]
    upgrades: list[subprocess.CompletedProcess[str]]
    gpu_b: int


def _operate(
    deployment: Deployment,
    production: ProductionBroker,
    watch: _ArgvWatch,
    secrets_: tuple[str, str | None, str | None],
) -> _Ran:
    """The run, a GPU server started with --broker-password-file, status, export and
    db upgrade (with the password file, then with the password inside the URL)."""
    gpu_file, db_file, db_secret = secrets_
    directory, db_url = deployment.directory, deployment.db
    watch.start()
    try:
        coordinator = deployment.start_all()
        assert coordinator.wait(300) == 0, deployment.log("coordinator")
        gpu_b, gpu_b_log = _start_gpu_with_flag(deployment, production, gpu_file)
        try:
            _wait_online(gpu_b, gpu_b_log)
            watch.scan()  # gpu-b's argv, read while it is up
        finally:
            gpu_b.terminate()
            gpu_b.wait(30)
        db_env = {"EDGESPLIT_DB_PASSWORD_FILE": db_file} if db_file else {}
        status = _edgesplit(directory, "status", "--db", db_url, "--run", "e2e-1", env=db_env)
        export = _edgesplit(directory, "export", "--db", db_url, "--out", "onnx", env=db_env)
        upgrades = []
        if db_secret:
            flag = ("--db-password-file", str(db_file))
            upgrades.append(_edgesplit(directory, "db", "upgrade", "--db", db_url, *flag))
    finally:
        deployment.stop()
        watch.stop()
    if db_secret:
        inline = db_url.replace("@", f":{db_secret}@", 1)  # the password inside the URL
        upgrades.append(_edgesplit(directory, "db", "upgrade", "--db", inline))
    return _Ran(status, export, upgrades, gpu_b.pid)


def _outputs_checked(
    ran: _Ran, failures: list[subprocess.CompletedProcess[str]], db_secret: str | None
) -> list[str]:
    """Every command's output, after checking each did what it should."""
    status, export, upgrades = ran.status, ran.export, ran.upgrades
    assert "finished, last committed round 2" in status.stdout, status.stdout + status.stderr
    assert export.returncode == 0 and "max |onnx - torch|" in export.stdout, export.stderr
    for upgrade in upgrades:
        assert upgrade.returncode == 0, upgrade.stderr
        assert "is at the current schema" in upgrade.stdout
    if db_secret:
        assert ":***@" in upgrades[-1].stdout  # the URL is printed, its password masked
    for failure in failures:
        message = failure.stderr.strip()
        # 2: a malformed broker URL (configuration), 3: an unreachable database
        assert failure.returncode in (2, 3) and len(message.splitlines()) == 1, message
        assert ":***@" in message, message  # the URL named, its password masked
    outputs = [status.stdout + status.stderr, export.stdout + export.stderr]
    return outputs + [c.stdout + c.stderr for c in (*upgrades, *failures)]


def _assert_owner_only(db_url: str, db_secret: str | None, directory: Path) -> None:
    """The store and its checkpoints are the owner's alone."""
    if db_secret is None:
        database = Path(db_url.removeprefix("sqlite:///"))
        for path in database.parent.glob(database.name + "*"):
            if path.is_file():
                assert _mode(path) == 0o600, f"{path} is {oct(_mode(path))}"
        checkpoints = database.with_name(database.name + ".checkpoints")
    else:
        checkpoints = directory / "checkpoints"  # a PostgreSQL store's, as the harness names it
    tree = [checkpoints, *checkpoints.rglob("*")]
    assert any(p.is_file() for p in tree), "the run wrote checkpoints"
    for path in tree:
        expected = 0o700 if path.is_dir() else 0o600
        assert _mode(path) == expected, f"{path} is {oct(_mode(path))}"
