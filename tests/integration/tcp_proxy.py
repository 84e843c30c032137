"""A TCP proxy a test can cut: the database server seen through it goes away (connections
closed, new ones refused) and comes back, while the real server, which other tests share, runs
on untouched."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``host``:``target_port``."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._cut_next = False
        self._muted = False  # the server's answers are not passed back (a cut under way)
        self.port = 0
        self.restore()

    def restore(self) -> None:
        """Listen (again, on the same port)."""
        self._muted = False
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut_after_next_request(self) -> None:
        """Cut the proxy right after it passes the client's next message on to the server:
        the server gets it (a COMMIT, say) and acts on it, the client never hears back."""
        self._cut_next = True

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            # close() alone leaves it listening while a thread blocks in accept() on it
            _shut(listener)
            listener.close()
        with self._lock:
            sockets, self._open = self._open, []
        for sock in sockets:
            _shut(sock)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by cut()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for source, sink, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, up), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, up: bool) -> None:
        try:
            while data := source.recv(65536):
                if not up and self._muted:
                    break
                cutting = up and self._cut_next
                if cutting:  # muted first: an answer relayed before the cut would be heard
                    self._cut_next, self._muted = False, True
                sink.sendall(data)
                if cutting:
                    self.cut()
        except OSError:
            pass
        for sock in (source, sink):
            _shut(sock)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cut()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected, or closed already
        sock.shutdown(socket.SHUT_RDWR)
