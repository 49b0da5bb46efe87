"""A TCP proxy in front of a real server (the test Redis), which a test can cut and mend.

Cut, it closes every connection it carries and refuses new ones, as a server that died or a
network that split would; the server behind it keeps running for the other tests.

Every accepted connection is owned from its first moment (asyncio hands it over with a plain
call, before any task of the proxy runs; and while the proxy still dials the server behind it),
so ``stop`` closes all of them: none is left for the garbage collector to find unclosed after
the test's event loop has gone.
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

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
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
        for _ in range(3):  # connections the listener took just before: asyncio hands them over
            await asyncio.sleep(0)
        for handler in list(self._handlers):
            handler.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await _close(*self._writers)  # any whose handler was cancelled before it ran
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A plain function: asyncio calls it as it hands the connection over."""
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
    """Close ``writers`` and wait until their sockets are."""
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await writer.wait_closed()
