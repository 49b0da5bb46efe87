"""One request on the upstream, and stopping it there at once by closing its connection.

Every OpenAI-compatible server cancels a request whose connection closed (vLLM's own queue
included), whether it waits for its response, for its first byte or between tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from laneway.errors import Aborted, Expired

__all__ = ["UpstreamCall"]


@dataclass(slots=True)
class UpstreamCall:
    """One request on the upstream, for an abort to close."""

    headers: asyncio.Future[aiohttp.ClientResponse] | None = None
    response: aiohttp.ClientResponse | None = None
    aborted: bool = False
    expired: bool = False  # no first byte by the request's deadline: it never started
    timer: asyncio.TimerHandle | None = None

    def dropped(self, request_id: str, engine_ms: float) -> Aborted | Expired:
        if self.expired:
            return Expired(f"request {request_id}: no first byte from the upstream by its deadline")
        return Aborted(f"request {request_id} aborted upstream", engine_ms=engine_ms)

    def close(self) -> None:
        """Stop the request now: its connection closes, which the upstream reads as a cancel."""
        self.aborted = True
        if self.response is not None:
            self.response.close()
        elif self.headers is not None:
            self.headers.cancel()

    def expire(self) -> None:
        """Its deadline passed before its first byte: it never started."""
        self.expired = True
        self.close()
