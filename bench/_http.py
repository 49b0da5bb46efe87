"""A minimal HTTP/1.1 keep-alive client for load generation (POST JSON, read the response).

httpx spends more CPU per request than the ingress under test does; on a 2-core machine
that would measure the load generator. This client does one write and reads one response
per request over pooled connections, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson

__all__ = ["HttpPool"]


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
        payload = orjson.dumps(body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{self._head}{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        async with self._limit:
            for attempt in (1, 2):
                if self._idle and attempt == 1:
                    reader, writer = self._idle.pop()
                else:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
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
                    length = int(response_headers.get("content-length", "0"))
                    data = await reader.readexactly(length)
                except BaseException:
                    writer.close()
                    raise
                self._idle.append((reader, writer))
                return status, response_headers, data
        raise ConnectionError(f"{self.host}:{self.port} closed the connection twice")

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._idle.clear()
