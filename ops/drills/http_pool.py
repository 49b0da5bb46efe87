"""A minimal HTTP/1.1 keep-alive client for load generation (POST JSON, read the response).

httpx spends more CPU per request than the ingress under test does; on a 2-core machine
that would measure the load generator. This client does one write and reads one response
per request over pooled connections, and nothing else; ``stream`` reads a streamed (SSE)
response line by line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import orjson

__all__ = ["HttpPool", "server_timing"]


class HttpPool:
    def __init__(self, host: str, port: int, headers: dict[str, str], size: int = 256) -> None:
        self.host = host
        self.port = port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._limit = asyncio.Semaphore(size)

    async def post(
        self, path: str, body: object, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        async with self._limit:
            reader, writer, status, response_headers = await self._send(path, body, headers)
            try:
                data = b"".join([part async for part in _body(reader, response_headers)])
            except BaseException:
                writer.close()
                raise
            self._keep(reader, writer, response_headers)
            return status, response_headers, data

    @contextlib.asynccontextmanager
    async def stream(
        self,
        path: str,
        body: object,
        headers: dict[str, str] | None = None,
        dials: list[float] | None = None,
    ) -> AsyncIterator[tuple[int, dict[str, str], AsyncIterator[bytes]]]:
        """POST, then the response body line by line (an SSE stream). Leaving the block
        before the body ended, or on an error or a cancellation, closes the connection, as a
        client that walks away does. When no pooled connection was free and a new one was
        opened, the time that took (ms) is appended to ``dials``."""
        async with self._limit:
            reader, writer, status, response_headers = await self._send(path, body, headers, dials)
            ended = False

            async def lines() -> AsyncIterator[bytes]:
                nonlocal ended
                pending = b""
                async for part in _body(reader, response_headers):
                    *complete, pending = (pending + part).split(b"\n")
                    for line in complete:
                        yield line.rstrip(b"\r")
                ended = True
                if pending:
                    yield pending

            try:
                yield status, response_headers, lines()
            except BaseException:
                writer.close()
                raise
            if ended:
                self._keep(reader, writer, response_headers)
            else:
                writer.close()

    def _keep(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]
    ) -> None:
        """Back to the pool, unless the server said it closes the connection."""
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))

    async def _send(
        self,
        path: str,
        body: object,
        headers: dict[str, str] | None,
        dials: list[float] | None = None,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
        """Write the request on a pooled connection (or a new one, its dial time appended to
        ``dials``) and read the status line and headers."""
        payload = orjson.dumps(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{self._head}{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        for attempt in (1, 2):
            if self._idle and attempt == 1:
                reader, writer = self._idle.pop()
            else:
                dialling = time.perf_counter()
                reader, writer = await asyncio.open_connection(self.host, self.port)
                if dials is not None:
                    dials.append((time.perf_counter() - dialling) * 1000)
            try:
                writer.write(request)
                status_line = await reader.readline()
                if not status_line and attempt == 1:
                    writer.close()  # the server closed this idle connection: dial anew
                    continue
                status = int(status_line.split()[1])
                response_headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    response_headers[name.strip().lower()] = value.strip()
            except BaseException:
                writer.close()
                raise
            return reader, writer, status, response_headers
        raise ConnectionError(f"{self.host}:{self.port} closed the connection twice")

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._idle.clear()


def server_timing(header: str) -> dict[str, float]:
    """The durations (ms) of a ``Server-Timing`` header, by name: ``admit;dur=0.4, ...``."""
    parts = {}
    for part in header.split(", "):
        name, _, dur = part.partition(";dur=")
        if dur:
            parts[name] = float(dur)
    return parts


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """A response body as it arrives: by Content-Length, or chunk by chunk."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        yield await reader.readexactly(int(headers.get("content-length", "0")))
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()  # the empty line after the last chunk (no trailers)
            return
        chunk = await reader.readexactly(size + 2)
        yield chunk[:size]
