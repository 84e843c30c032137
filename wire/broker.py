"""A mosquitto broker for development and tests, with a generated configuration.

MQTT v5 is always on in mosquitto 2. The configuration raises ``max_packet_size`` above the
Channel's chunk size and lifts the per-client queue bound (``max_queued_messages 0``), so QoS 1
data is never dropped by the broker.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from wire.errors import TransportError

__all__ = ["Broker", "broker_config", "free_port"]

INSTALL_HINT = (
    "mosquitto is not installed; install it with `apt-get install mosquitto` "
    "(Debian/Ubuntu) or `brew install mosquitto` (macOS)"
)
MAX_PACKET_BYTES = 80 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def broker_config(
    port: int, extra: str = "", persistence_dir: Path | None = None, anonymous: bool = True
) -> str:
    lines = [
        f"listener {port} 127.0.0.1",
        f"allow_anonymous {'true' if anonymous else 'false'}",
        f"max_packet_size {MAX_PACKET_BYTES}",
        "max_queued_messages 0",
        "max_queued_bytes 0",
        "max_inflight_messages 0",
        "set_tcp_nodelay true",
        "persistent_client_expiration 1h",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # A development broker on loopback: keep the invoking user instead of switching to
        # 'mosquitto', so it can read files (passwords, ACLs) that the caller wrote.
        lines.append("user root")
    if persistence_dir is not None:
        lines += ["persistence true", f"persistence_location {persistence_dir}/"]
    return "\n".join(lines) + "\n" + extra


class Broker:
    """Runs mosquitto in the foreground on a loopback port until ``stop()``."""

    def __init__(
        self,
        port: int | None = None,
        extra_config: str = "",
        persistence: bool = False,
        anonymous: bool = True,
        config: str | None = None,
    ) -> None:
        """``config``, when given, is the whole configuration, used as it is (it must listen on
        127.0.0.1 at ``port``); otherwise one is generated."""
        executable = shutil.which("mosquitto") or (
            "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
        )
        if executable is None:
            raise TransportError(INSTALL_HINT)
        self.executable = executable
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="edgesplit-broker-"))
        persistence_dir = self._dir if persistence else None
        self.config_path = self._dir / "mosquitto.conf"
        self.log_path = self._dir / "mosquitto.log"
        self.config_path.write_text(
            config
            if config is not None
            else broker_config(self.port, extra_config, persistence_dir, anonymous)
        )
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def directory(self) -> Path:
        """The broker's private folder (its configuration, persistence), removed on exit."""
        return self._dir

    def start(self, timeout: float = 10.0) -> Broker:
        with socket.socket() as probe:
            # As mosquitto does: connections in TIME_WAIT after a restart do not block the port,
            # a listening process does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", self.port))
            except OSError as error:
                raise TransportError(
                    f"port {self.port} on 127.0.0.1 is in use ({error.strerror}); choose "
                    "another with --port or stop what listens there"
                ) from error
        # mosquitto logs every connection to stderr: into a file, as an unread pipe fills
        # after 64 KiB and the broker then blocks on its next log line (a device reconnecting
        # a few hundred times froze every client)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [self.executable, "-c", str(self.config_path)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                # its own process group: a terminal's Ctrl-C reaches only its owner, which
                # stops it and removes its folder (a broker killed first left the folder)
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                output = self.log_path.read_text(errors="replace")[-4000:]
                raise TransportError(f"mosquitto exited at start: {output.strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TransportError(f"mosquitto did not listen on port {self.port} in {timeout} s")

    def stop(self) -> None:
        """SIGTERM mosquitto (it saves its state and publishes every client's will), SIGKILL
        it after 5 s."""
        if self._process is not None:
            _end(self._process, signal.SIGTERM, 5.0)
        self._process = None

    def restart(self, down: float = 0.0, kill: bool = False) -> None:
        """Stop mosquitto (SIGTERM: it saves its state and publishes every client's will;
        ``kill``: SIGKILL, it loses what arrived since its last autosave), stay down
        ``down`` seconds, start it again on the same port with the same persistence."""
        if kill:
            self.kill()
        else:
            self.stop()
        time.sleep(down)
        self.start()

    def kill(self) -> None:
        """SIGKILL mosquitto, as a crash or an OOM kill would (for fault tests)."""
        if self._process is not None:
            _end(self._process, signal.SIGKILL, 0.0)
        self._process = None

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop mosquitto and remove its folder (configuration, log, persistence)."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def wait(self) -> int:
        """Block until mosquitto exits (the foreground ``edgesplit broker`` command), its exit
        code. Polls: the kernel may hand SIGTERM to another thread of this process (numpy's
        BLAS starts one), and then a wait blocked in the main thread's ``waitpid`` is not
        interrupted, so Python never runs the handler that stops the command (it hung so)."""
        if self._process is None:
            return 0
        while (code := _reaped(self._process)) is None:
            time.sleep(0.1)
        return code


# mosquitto is stopped and waited for by its pid, not by Popen.wait, whose lock a signal
# raising at the wrong moment could leave held (an interrupted `with lock:`, bpo-29988), after
# which every Popen.wait blocks for ever.


def _reaped(process: subprocess.Popen[bytes], block: bool = False) -> int | None:
    """The exit code of ``process`` once it has exited (then reaped), else None; ``block``:
    wait for it."""
    if process.returncode is not None:
        return process.returncode
    try:
        pid, status = os.waitpid(process.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:  # reaped already (Popen's own calls before any signal)
        return process.returncode if process.returncode is not None else -1
    if pid == 0:
        return None
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode


def _end(process: subprocess.Popen[bytes], signum: int, patience: float) -> None:
    """Send ``signum`` to ``process``, wait up to ``patience`` s for it to exit, then SIGKILL
    it; reaped either way."""
    if _reaped(process) is not None:
        return
    os.kill(process.pid, signum)  # not reaped, so the pid is still this child's
    deadline = time.monotonic() + patience
    while _reaped(process) is None:
        if time.monotonic() >= deadline:
            os.kill(process.pid, signal.SIGKILL)
            _reaped(process, block=True)
            return
        time.sleep(0.01)
