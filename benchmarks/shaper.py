"""A user-space link shaper: a TCP proxy in front of the broker that holds each direction of a
connection to a rate (a token bucket per direction). No added latency: only bandwidth.

``tc netem`` would do this in the kernel, but this machine's kernel has no ``sch_netem``
("Specified qdisc kind is unknown"). A proxy per device shapes what that device sends and
receives, which is what a slow link does to it; it adds one extra hop on loopback (tens of
microseconds) and the proxy's own CPU (it runs in the benchmark's process).

    with Shaper(("127.0.0.1", 1883), up=5e6 / 8, down=20e6 / 8) as link:
        ...  # connect the device to mqtt://127.0.0.1:{link.port}
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

__all__ = ["Shaper"]

_CHUNK = 16 * 1024


class _Bucket:
    """Bytes per second with a burst of one chunk."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.free_at = rate, time.monotonic()

    def delay_for(self, size: int) -> float:
        """Seconds to wait before ``size`` bytes may go."""
        if self.rate is None:
            return 0.0
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + size / self.rate
        return max(0.0, self.free_at - now - _CHUNK / self.rate)


class Shaper:
    """Listens on a free loopback port and forwards to ``target``, shaped (bytes/s; None:
    unlimited)."""

    def __init__(
        self,
        target: tuple[str, int],
        up: float | None,
        down: float | None = None,
    ) -> None:
        self.target, self.up, self.down = target, up, down
        self.port = 0
        self.forwarded = [0, 0]  # bytes up, down
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shaper", daemon=True)

    def __enter__(self) -> Shaper:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the shaper did not start")
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._connect, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pipe(reader, upstream_writer, _Bucket(self.up), 0),
            self._pipe(upstream_reader, writer, _Bucket(self.down), 1),
        )

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        bucket: _Bucket,
        direction: int,
    ) -> None:
        try:
            while chunk := await reader.read(_CHUNK):
                wait = bucket.delay_for(len(chunk))
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
                self.forwarded[direction] += len(chunk)
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
