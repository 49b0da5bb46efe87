"""The suite's sockets name the code that made them (tests/socket_origins.py), so a socket
left open fails its test with a warning that says whose it was."""

from __future__ import annotations

import asyncio
import socket


def test_a_socket_names_the_test_that_made_it() -> None:
    with socket.socket() as sock:
        assert "made at tests/test_socket_origins.py:" in repr(sock)


async def test_asyncio_connections_name_their_maker_both_ends() -> None:
    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()
    server = await asyncio.start_server(lambda _r, w: accepted.put_nowait(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    taken = await asyncio.wait_for(accepted.get(), 10)
    try:
        # The client's end: the test that opened it; the server's: asyncio's accept.
        assert "tests/test_socket_origins.py:" in repr(writer.transport)
        assert "made at asyncio/selector_events.py:" in repr(taken.transport)
    finally:
        for end in (writer, taken):
            end.close()
            await end.wait_closed()
        server.close()
        await server.wait_closed()
