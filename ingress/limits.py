"""The ingress bounds request bodies itself, whatever proxy does or does not sit in front.

A body longer than ``LANEWAY_MAX_BODY_BYTES`` gets 413 before it is read: at once when its
``Content-Length`` says so, else (chunked) as soon as what arrived passes the limit. A pure
ASGI middleware, so the hot paths pay a header lookup and nothing more.

A chunked body is not held here: it reaches the app as it comes, counted, so a caller
without a key is answered before its body is read (held first, thousands of slow bodies
without a key were each up to the limit in memory); past the limit the app is told the
client left and the client gets the 413 instead of the app's answer. A path may have a
limit of its own (file uploads, ``LANEWAY_MAX_FILE_BYTES``: 100 MiB).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingress.errors import error_response
from laneway.errors import BodyTooLarge

__all__ = ["OVER_LIMIT", "BodyLimit"]

# Set in the request's scope when its body passed the limit: the app was told the client
# left, and the client gets a 413.
OVER_LIMIT = "laneway.body_over_limit"


class BodyLimit:
    def __init__(
        self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}  # paths with a limit of their own (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope["path"], self.max_bytes)
        length = _content_length(scope)
        if length is not None:
            # The server reads no more than Content-Length says: the header is the size.
            if length > limit:
                await self._refuse(length, limit, scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if not _chunked(scope):
            await self.app(scope, receive, send)
            return
        await self._counted(limit, scope, receive, send)

    async def _counted(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        size = 0
        over = started = False

        async def counting() -> Message:
            nonlocal size, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    over = True
                    scope[OVER_LIMIT] = True  # the app counts a 413, not a client gone
                    return {"type": "http.disconnect"}
            return message

        async def answering(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the app's answer to a body it never got whole: the 413 goes instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, answering)
        except Exception:
            if not over:
                raise
        if over and not started:
            await self._refuse(size, limit, scope, receive, send, at_least=True)

    async def _refuse(
        self,
        size: int,
        limit: int,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        at_least: bool = False,
    ) -> None:
        # A chunked body is cut off where it passed the limit: its size is not known.
        size_part = "" if at_least else f" is {size} bytes,"
        setting = "LANEWAY_MAX_BODY_BYTES" if limit == self.max_bytes else "LANEWAY_MAX_FILE_BYTES"
        exc = BodyTooLarge(f"request body{size_part} over the limit of {limit} bytes ({setting})")
        response = error_response(exc)
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    raw = _header(scope, b"content-length")
    if raw is None or not raw.isdigit():
        return None  # absent; a malformed one the server has refused already
    return int(raw)


def _chunked(scope: Scope) -> bool:
    raw = _header(scope, b"transfer-encoding")
    return raw is not None and b"chunked" in raw.lower()
