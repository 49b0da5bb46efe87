"""Clients that send a request too slowly (slowloris): each connection is bounded, so a few
clients cannot hold the ingress's connections (its file descriptors) for ever."""

from __future__ import annotations

import asyncio
import contextlib

from tests.stack import LiveStack


async def _closed_by_the_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (waits 15 s at most)."""
    return await asyncio.wait_for(reader.read(), 15)


async def test_a_connection_whose_headers_do_not_come_is_closed(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(read_timeout_s=1)
    # Nothing at all, half a request line's headers, and half the headers of a second
    # request on a connection kept alive after a first one.
    silent = await asyncio.open_connection("127.0.0.1", ingress.port)
    half = await asyncio.open_connection("127.0.0.1", ingress.port)
    half[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: laneway\r\nContent-Ty")
    kept = await asyncio.open_connection("127.0.0.1", ingress.port)
    kept[1].write(b"GET /healthz HTTP/1.1\r\nHost: laneway\r\n\r\n")
    first = await kept[0].readuntil(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), first
    await kept[0].read(int(first.split(b"content-length: ")[1].split(b"\r\n")[0]))
    kept[1].write(b"GET /healthz HTTP/1.1\r\nHo")  # keep-alive's own timer stops here
    for reader, writer in (silent, half, kept):
        assert await _closed_by_the_server(reader) == b""
        writer.close()


async def test_a_request_answered_before_its_body_came_closes_its_connection(
    stack: LiveStack,
) -> None:
    """No key: 401 before the body is read. The rest of the body, a byte now and then, must
    not hold the connection open with no request left to bound it."""
    ingress = await stack.start_ingress(read_timeout_s=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", ingress.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: laneway\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
    )
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    writer.write(b" ")
    with contextlib.suppress(ConnectionError):
        await _closed_by_the_server(reader)  # the 401's body, then the end
    writer.close()


async def test_a_body_that_does_not_come_is_answered_408(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(read_timeout_s=1)
    key = await stack.api_key("slow-body")
    reader, writer = await asyncio.open_connection("127.0.0.1", ingress.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: laneway\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        + b'{"model": "lane'
    )
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    body = await reader.read(int(answer.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    assert b"LANEWAY_READ_TIMEOUT_S" in body
    writer.close()
    # An ordinary request is served as ever.
    http = stack.http(ingress, key)
    assert (await http.get("/v1/models")).status_code == 200
