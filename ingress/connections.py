"""The ingress's HTTP server: uvicorn, with a bound on how long a client may take to send a
request, whatever proxy does or does not sit in front.

uvicorn closes a connection idle between requests (keep-alive, 5 s), but not one that has
sent nothing yet, or half a request's headers: a client without a key could open tens of
thousands such connections and hold them, until the ingress had no file descriptor left for
anyone. Here a connection whose request's headers are not complete within
``LANEWAY_READ_TIMEOUT_S`` of its opening (or of the request's first byte, after a
keep-alive) is closed; the completion and chat routes bound their bodies the same way
(``ingress.completions``: 408), and so is the rest of the body of a request answered
before its body came whole (a 401 before the body is read). A load balancer's own limits per client
still belong in front (docs/security.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ingress.settings import IngressSettings

__all__ = ["server_config"]


class _DeadlinedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose headers come too slowly."""

    read_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._expect_headers()  # a request after a keep-alive: its headers are due too

    def on_headers_complete(self) -> None:
        self._headers_came()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body:
            # Answered before its body came whole (401 before the body is read, 413, 408):
            # the rest is read and dropped, within the same bound, else the connection is
            # closed (at once would reset it under the client still sending, before it
            # read the answer).
            self._expect_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_came()
        super().connection_lost(exc)

    def _expect_headers(self) -> None:
        if self._headers_due is None:
            self._headers_due = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _headers_came(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _too_slow(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.close()


def server_config(app: Any, settings: IngressSettings, **overrides: Any) -> uvicorn.Config:
    """How the ingress serves ``app`` (``python -m ingress``, and the tests' in-process one)."""
    protocol = type("DeadlinedHttp", (_DeadlinedHttp,), {"read_timeout_s": settings.read_timeout_s})
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "access_log": False,
        "server_header": False,  # no "server: uvicorn" to tell a prober what to aim at
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
        "http": protocol,
        **overrides,
    }
    return uvicorn.Config(app, **options)
