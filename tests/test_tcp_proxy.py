"""The test proxy itself: ``stop`` leaves no connection open, not even one it accepted a
moment before and was still dialling the server behind for (left open, the garbage collector
finds it later and fails whichever test is running then)."""

from __future__ import annotations

import asyncio
import gc

from tests.tcp_proxy import TcpProxy


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
