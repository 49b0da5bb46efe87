"""Sockets of the test process that say where they were made.

A socket left open is reported by the garbage collector as ``unclosed <socket.socket fd=..,
laddr=.., raddr=..>``, in whichever test it runs, with no word on the code that opened it;
the suite's rare unclosed-socket failures could not be traced from that. Installed by the
conftest, every socket (``socket.socket``, and so every connection asyncio opens or accepts)
keeps a short summary of the stack that made it, and its repr (and its asyncio
transport's), which the warning prints, ends with it: ``made at asyncio/base_events.py:950
<- aiokafka/conn.py:216 <- aiokafka/client.py:200 <- ingress/prober.py:147 <- ...``.
A stack summary without source lines costs little: about 9 µs more a socket (15 against
6–8 µs to make and close one, measured with timeit from a shallow stack).
"""

from __future__ import annotations

import asyncio.selector_events
import socket
import traceback
from typing import Any

# Named in the repr, innermost first: the frame that made the socket, the nearest frames of
# a client library (aiokafka, redis-py, httpx) and of this repository.
_CLIENT_FRAMES = 2
_OWN_FRAMES = 4


def _short(filename: str) -> str:
    if "/site-packages/" in filename:
        return filename.rsplit("/site-packages/", 1)[1]
    if "/lib/python3" in filename:  # the standard library: .../lib/python3.11/asyncio/x.py
        return filename.split("/lib/python3", 1)[1].split("/", 1)[1]
    return "/".join(filename.split("/")[-2:])


def _own(filename: str) -> bool:
    return not any(p in filename for p in ("/site-packages/", "/lib/python3", "/.venv/", "<"))


class TracedSocket(socket.socket):
    __slots__ = ("_listener", "_origin")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._origin = traceback.StackSummary.extract(
            traceback.walk_stack(None), limit=40, lookup_lines=False
        )
        self._listener: str | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        """A connection a server took names that server (asyncio accepts it in a callback,
        whose stack says nothing of whose server it was)."""
        sock, address = super().accept()
        if isinstance(sock, TracedSocket):
            sock._listener = self.origin()
        return sock, address

    def origin(self) -> str:
        frames = [
            f for f in self._origin if not f.filename.endswith(("/socket.py", "/socket_origins.py"))
        ]
        libraries = [i for i, f in enumerate(frames) if not _own(f.filename)]
        clients = [i for i in libraries if "/asyncio/" not in frames[i].filename]
        own = [i for i, f in enumerate(frames) if _own(f.filename)]
        shown = sorted({*libraries[:1], *clients[:_CLIENT_FRAMES], *own[:_OWN_FRAMES]})
        return " <- ".join(f"{_short(frames[i].filename)}:{frames[i].lineno}" for i in shown)

    def whence(self) -> str:
        if self._listener is not None:
            return f"accepted by the server made at {self._listener}"
        return f"made at {self.origin()}"

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, {self.whence()}>"


def install() -> None:
    """Make every socket of this process from now on a ``TracedSocket``, and have asyncio's
    transports (whose own warning closes the socket before it can warn) name it too."""
    socket.socket = TracedSocket  # type: ignore[misc]
    transport = asyncio.selector_events._SelectorTransport
    plain = transport.__repr__

    def traced(self: Any) -> str:
        text = plain(self)
        sock = getattr(self, "_sock", None)
        if not isinstance(sock, TracedSocket):
            return text
        return f"{text[:-1]} {sock.whence()}>"

    transport.__repr__ = traced  # type: ignore[method-assign]
