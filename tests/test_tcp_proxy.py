"""The test proxy itself: ``stop`` leaves no connection open, not one it accepted a moment
before and was still dialling the server behind for, not one whose peer stopped reading, not
one of many dialled while it stops (left open, the garbage collector finds it later and fails
whichever test is running then: it did, in test_api_keys), and it never waits on a peer."""

from __future__ import annotations

import asyncio
import gc

from tests.stack import eventually
from tests.tcp_proxy import TcpProxy, _closed


async def test_stop_closes_a_connection_accepted_while_dialling() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.read(100))
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1])
    await proxy.start()
    try:
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            await asyncio.sleep(0)  # accepted; the proxy is dialling the target
            await proxy.stop()
            assert await asyncio.wait_for(reader.read(100), 2) == b""  # closed by the proxy
            writer.close()
            await writer.wait_closed()
            await proxy.start()
    finally:
        await proxy.stop()
        target.close()
        await target.wait_closed()
    gc.collect()  # an unclosed transport would warn here, and warnings are errors


async def test_stop_closes_a_connection_whose_peer_does_not_read() -> None:
    chunk = b"x" * 65536

    async def flood(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # far more than the sockets between here and the client can hold
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.close()

    target = await asyncio.start_server(flood, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1])
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        # The client reads nothing: the proxy's side towards it fills up and holds bytes.
        await eventually(
            lambda: any(t.get_write_buffer_size() for t in proxy._transports),
            10,
            "bytes waiting in the proxy for the client",
        )
        async with asyncio.timeout(10):
            await proxy.stop()
        assert all(_closed(t) for t in proxy._transports)
        async with asyncio.timeout(10):  # the client sees its connection end
            while await reader.read(1 << 20):
                pass
    finally:
        writer.close()
        target.close()
        await target.wait_closed()


async def test_stop_leaves_no_connection_open_while_clients_keep_dialling() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1])
    await proxy.start()
    held: list[asyncio.StreamWriter] = []
    stopping = asyncio.Event()

    async def dial() -> None:  # as a Redis client reconnecting while the proxy goes away
        while not stopping.is_set():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            except OSError:
                await asyncio.sleep(0)
                continue
            held.append(writer)

    dialers = [asyncio.ensure_future(dial()) for _ in range(4)]
    try:
        await eventually(lambda: len(held) >= 20, 10, "20 connections through the proxy")
        await proxy.cut_off()
        await proxy.stop()
        stopping.set()
        await asyncio.gather(*dialers)
        assert proxy._transports, "the proxy carried nothing: the test proves nothing"
        assert all(_closed(t) for t in proxy._transports)
    finally:
        stopping.set()
        for writer in held:
            writer.close()
        target.close()
        await target.wait_closed()
