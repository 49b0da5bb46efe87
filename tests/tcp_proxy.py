"""A TCP proxy in front of a real server (the test Redis), which a test can cut and mend.

Cut, it closes every connection it carries and refuses new ones, as a server that died or a
network that split would; the server behind it keeps running for the other tests.

Every accepted connection is owned from its ``accept``: the proxy accepts them itself, one
at a time, and makes each one's transport before it accepts the next. ``stop`` wakes that
loop with a connection of its own, the loop ends there (no cancel, which could drop a socket
just accepted), and every connection it took is closed, aborted if a close would wait on
unsent bytes: none is left for the garbage collector to find unclosed after the test's event
loop has gone. (An ``asyncio`` server does not do: on Python 3.11 a connection accepted just
before ``Server.close`` fails to get its transport, ``_attach``'s assertion, and its socket is
left open.)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from functools import partial


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.cut = False
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._stopping = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._transports: list[asyncio.WriteTransport] = []  # every one, closed or not

    async def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept_loop(self._listener))

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if self._stopping:  # the wake-up from ``stop``, or one that came with it
                conn.close()
                return
            reader = asyncio.StreamReader()
            try:
                transport, protocol = await loop.connect_accepted_socket(
                    partial(asyncio.StreamReaderProtocol, reader), conn
                )
            except OSError:  # the client has gone already
                conn.close()
                continue
            self._accepted(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    async def cut_off(self) -> None:
        """Close what it carries and refuse new connections until ``mend``."""
        self.cut = True
        for writer in list(self._writers):
            writer.close()
        await asyncio.sleep(0)

    def mend(self) -> None:
        self.cut = False

    async def stop(self) -> None:
        """Stop accepting, then close every connection, those still being dialled included."""
        self.cut = True
        if self._accepting is not None and not self._accepting.done():
            self._stopping = True
            _, wake = await asyncio.open_connection("127.0.0.1", self.port)
            await self._accepting  # ends at the wake-up: every connection before it is ours
            wake.close()
        if self._listener is not None:
            self._listener.close()  # what is still in its backlog is refused
        for handler in list(self._handlers):
            handler.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await _close(*self._writers)  # any whose handler was cancelled before it ran
        self._writers.clear()
        # A close with bytes still unsent waits for the peer to read them: do not wait.
        for transport in self._transports:
            if not _closed(transport):
                transport.abort()
        for _ in range(100):  # an abort lets go of the socket on the next tick
            if all(_closed(t) for t in self._transports):
                break
            await asyncio.sleep(0)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection taken: carried until a cut or ``stop``."""
        self._transports.append(writer.transport)
        self._writers.add(writer)
        handler = asyncio.ensure_future(self._serve(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer: asyncio.StreamWriter | None = None
        pipes: list[asyncio.Future[None]] = []
        try:
            if self.cut:
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(up_writer)
            self._transports.append(up_writer.transport)
            if self.cut:  # cut while dialling
                return
            pipes = [
                asyncio.ensure_future(self._pipe(reader, up_writer)),
                asyncio.ensure_future(self._pipe(up_reader, writer)),
            ]
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for pipe in pipes:
                pipe.cancel()
            ends = [w for w in (writer, up_writer) if w is not None]
            self._writers.difference_update(ends)
            await _close(*ends)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()


async def _close(*writers: asyncio.StreamWriter) -> None:
    """Close ``writers`` and wait until their sockets are: at once, as a cut would, even when
    bytes are still unsent (a close would wait for a peer that may never read them)."""
    for writer in writers:
        writer.close()
        if writer.transport.get_write_buffer_size():
            writer.transport.abort()
    for writer in writers:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await writer.wait_closed()


def _closed(transport: asyncio.BaseTransport) -> bool:
    """Its socket is closed: a transport closing with bytes unsent still holds it."""
    sock = transport.get_extra_info("socket")
    return sock is None or sock.fileno() == -1
