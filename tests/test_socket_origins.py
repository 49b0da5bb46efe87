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
        # The client's end: the test that opened it; the server's: the test that started
        # the server.
        assert "made at asyncio/base_events.py:" in repr(writer.transport)
        assert "tests/test_socket_origins.py:" in repr(writer.transport)
        taken_by = repr(taken.transport)
        assert "accepted by the server made at asyncio/base_events.py:" in taken_by
        assert "tests/test_socket_origins.py:" in taken_by
    finally:
        for end in (writer, taken):
            end.close()
            await end.wait_closed()
        server.close()
        await server.wait_closed()
