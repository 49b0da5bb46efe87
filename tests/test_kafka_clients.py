"""A Kafka client whose start is cancelled leaves no connection open (``start_client``).

aiokafka's bootstrap closes its first connection when the metadata request fails, not when it
is cancelled while waiting for the answer; a probe's timeout did that, and the socket stayed
open until the garbage collector found it. The broker is the real one of the test setup."""

from __future__ import annotations

import asyncio
import os

from aiokafka import AIOKafkaConsumer

from laneway.clients import make_consumer, start_client
from laneway.settings import CommonSettings
from tests.stack import Services


def _connections_to(port: int) -> int:
    """Established TCP connections of this process to 127.0.0.1:``port``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and int(remote.split(":")[1], 16) == port and inode in inodes:
                count += 1
    return count


async def test_a_start_cancelled_at_any_moment_leaves_no_connection(services: Services) -> None:
    settings = CommonSettings(kafka_bootstrap=services.bootstrap, **services.admin_settings())
    port = int(services.bootstrap.rsplit(":", 1)[1])
    before = _connections_to(port)
    cut_short = 0
    # Cancels from the first moment to past a whole start, a millisecond apart: some land
    # while connecting, some while the broker answers the version and metadata requests.
    for delay_ms in range(0, 60, 1):
        consumer: AIOKafkaConsumer = make_consumer(settings)
        starting = asyncio.ensure_future(start_client(consumer))
        await asyncio.sleep(delay_ms / 1000)
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            cut_short += 1
        else:
            await consumer.stop()  # it had started before the cancel came
    assert cut_short > 0, "no start was cancelled: the test proves nothing"
    await asyncio.sleep(0.2)  # a closed transport lets go of its socket a moment later
    assert _connections_to(port) <= before  # fewer if another client let one go meanwhile
