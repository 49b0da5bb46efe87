"""A TCP proxy in front of a real server (the test Redis), which a test can cut and mend.

Cut, it closes every connection it carries and refuses new ones, as a server that died or a
network that split would; the server behind it keeps running for the other tests.

Every accepted connection is owned from its first moment: the proxy makes the protocol of
each one itself, so it counts a connection the tick after asyncio accepted it, before asyncio
hands it over (a tick or two later). ``stop`` waits until every counted connection has been
handed over, closes them all and finally aborts any that a close left waiting on unsent bytes:
none is left for the garbage collector to find unclosed after the test's event loop has gone.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.cut = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._accepted_n = 0  # protocols made: connections asyncio accepted
        self._handed_over_n = 0  # of those, handed to ``_accepted``
        self._transports: list[asyncio.WriteTransport] = []  # every one, closed or not

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.StreamReaderProtocol:
            # What asyncio.start_server makes, counted: asyncio calls this as it accepts.
            self._accepted_n += 1
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._accepted)

        self._server = await loop.create_server(protocol, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

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
        if self._server is not None:
            self._server.close()
        # Accepted just before: asyncio makes the protocol a tick after the accept, and hands
        # the connection over a tick or two later.
        for tick in range(100):
            await asyncio.sleep(0)
            if tick >= 2 and self._handed_over_n >= self._accepted_n:
                break
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
        if self._server is not None:
            await self._server.wait_closed()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A plain function: asyncio calls it as it hands the connection over."""
        self._handed_over_n += 1
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
