"""Session setup: one real Kafka broker and one real Redis on test ports of their own.

The ports are free ones picked at start (so the suite runs beside `make up`, a bench or
another checkout's suite); LANEWAY_TEST_KAFKA_PORT / LANEWAY_TEST_REDIS_PORT pin them.
`make test` runs the suite in two processes (pytest-xdist, a test file stays in one), and each
starts its own broker and Redis.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ops.kafka_broker import KafkaBroker
from ops.redis_server import RedisServer
from tests import socket_origins
from tests.secured import SecuredServices
from tests.stack import (
    PARTITIONS,
    LiveStack,
    Services,
    free_port,
    free_port_pair,
    xdist_process,
)
from tests.upstream_process import UpstreamProcess


def _pinned(variable: str, step: int) -> int | None:
    """A port pinned by ``variable``; under `make test`'s test processes process i takes
    the pinned port + i × step (the broker also listens on its port + 1)."""
    value = os.environ.get(variable)
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise pytest.UsageError(f"{variable} must be a port number (1-65535), got {value!r}")
    return int(value) + xdist_process()[0] * step


KAFKA_PORT = _pinned("LANEWAY_TEST_KAFKA_PORT", 2) or free_port_pair()
REDIS_PORT = _pinned("LANEWAY_TEST_REDIS_PORT", 1) or free_port()

# A socket left open names the code that opened it in the warning that fails its test.
socket_origins.install()


# The HTTP fuzz suite sends this many generated requests in `make test`; more on demand:
# `.venv/bin/pytest tests/test_fuzz_http.py --fuzz-examples 50000 --timeout 0`.
FUZZ_EXAMPLES = 3000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=FUZZ_EXAMPLES,
        help=f"requests the HTTP fuzz suite generates (default {FUZZ_EXAMPLES})",
    )
    parser.addoption(
        "--console-screenshot",
        default=None,
        help="tests/test_console_browser.py saves the console's overview here as a PNG "
        "(the README's docs/img/console.png)",
    )
    parser.addoption(
        "--fuzz-seed",
        type=int,
        default=None,
        help="seed of the HTTP fuzz suite (default: the same every run, so CI is repeatable)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test first (their order kept): `make test`'s test processes
    take whole files in this order (``--no-loadscope-reorder``), so a long drill starts
    early rather than run alone at the end while the other process idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("services")
    # As `make up` runs it: an append-only file, and noeviction under a memory bound.
    redis = RedisServer(port=REDIS_PORT, data_dir=root / "redis", persistent=True)
    kafka = KafkaBroker(
        port=KAFKA_PORT, data_dir=root / "kafka", heap_mb=512, partitions=PARTITIONS
    )
    redis.start()
    try:
        kafka.start()
        try:
            yield Services(kafka.bootstrap, redis.url, broker_pid=kafka.pid)
        finally:
            kafka.stop()
    finally:
        redis.stop()


@pytest.fixture(scope="session")
def secured_services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredServices]:
    """A second Kafka and Redis in the secured mode (SASL/SCRAM, ACLs, Redis ACL users),
    started only for the tests that ask for it; the rest of the suite keeps the plain pair."""
    root = tmp_path_factory.mktemp("secured")
    secured = SecuredServices.generate()
    redis = RedisServer(port=free_port(), data_dir=root / "redis", users=secured.redis_users)
    kafka = KafkaBroker(
        port=free_port_pair(),
        data_dir=root / "kafka",
        heap_mb=512,
        partitions=PARTITIONS,
        admin=secured.kafka_admin,
    )
    redis.start()
    try:
        kafka.start()
        try:
            yield secured.started(kafka, redis)
        finally:
            kafka.stop()
    finally:
        redis.stop()


@pytest.fixture
def occupied_port() -> Iterator[int]:
    """A port something listens on for the test's length."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def stack(services: Services, prefix: str) -> AsyncIterator[LiveStack]:
    live = LiveStack(services, prefix)
    await live.create_topics()
    try:
        yield live
    finally:
        await live.stop()


@pytest.fixture
async def upstreams(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Starts separate upstream processes (``bench.upstream_server``), stopped after the test:
    ``await upstreams(slots=1, token_ms=40)``."""
    started: list[UpstreamProcess] = []

    async def start(**options: Any) -> UpstreamProcess:
        upstream = UpstreamProcess(tmp_path / f"upstream-{len(started)}.jsonl", **options)
        started.append(upstream)
        await upstream.ready()
        return upstream

    yield start
    for upstream in started:
        # In a thread: one that holds a connection open takes up to 10 s to stop, and the
        # loop (the test's workers' heartbeats among it) runs on meanwhile.
        await asyncio.to_thread(upstream.stop)
