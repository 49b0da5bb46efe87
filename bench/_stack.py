"""A throwaway laneway stack for benchmarks: real Kafka, Redis, ingress and worker processes.

Ports default to a range of their own (31xxx) so a bench runs beside `make up` and the tests,
and below the kernel's ephemeral range (32768 and up): a client that reconnects to a port in
that range while its server is down can be given that very port as its own and connect to
itself, and the port then stays taken (TIME_WAIT) for a minute after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from laneway.apikeys import create_key
from laneway.constants import RedisKeys, Topics
from laneway.settings import CommonSettings
from ops.devstack import stop_processes
from ops.kafka_broker import KafkaBroker
from ops.kafka_topics import create_topics
from ops.redis_server import RedisServer
from quota import Team, set_team

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchStack:
    kafka_port: int = 31092
    redis_port: int = 31379
    ingress_port: int = 31800
    partitions: int = 6
    prefix: str = "bench"
    ingress_env: dict[str, str] = field(default_factory=dict)
    jvm_options: list[str] = field(default_factory=list)  # extra JVM flags for the broker
    workers: list[dict[str, str]] = field(default_factory=list)
    streams: bool = False  # run the streams app too (its CPU per usage event counts)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # every process of the stack, by role
    # The ingress shows /readyz's checks only to the admin key (``ingress_admin_env``).
    admin_key: str = "bench-admin-key-0123"

    @property
    def ingress_admin_env(self) -> dict[str, str]:
        return {"LANEWAY_ADMIN_KEY": self.admin_key}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ingress_port}"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def topics(self) -> Topics:
        return Topics(self.prefix)

    def settings(self) -> CommonSettings:
        """Client settings that reach this stack (for BatchClient and the like)."""
        return CommonSettings(
            kafka_bootstrap=self.bootstrap,
            redis_url=self.redis_url,
            topic_prefix=self.prefix,
            redis_prefix=self.prefix,
        )

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
        env.update(
            PYTHONPATH=str(ROOT),
            LANEWAY_KAFKA_BOOTSTRAP=self.bootstrap,
            LANEWAY_REDIS_URL=self.redis_url,
            LANEWAY_TOPIC_PREFIX=self.prefix,
            LANEWAY_REDIS_PREFIX=self.prefix,
            LANEWAY_LOG_LEVEL="WARNING",
        )
        env.update(extra)
        return env

    def spawn(
        self, module: str, extra: dict[str, str], role: str | None = None
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", module], env=self._env(extra), cwd=ROOT)
        self.procs.append(proc)
        self.pids[role or module] = proc.pid
        return proc

    def api_key(self, team: str, size: int = 10_000, **policy: Any) -> str:
        """A key for ``team``, a team big enough that quota never limits the benchmark;
        ``policy``: other fields of its record (``type_through``, ...)."""

        async def make() -> str:
            redis = aioredis.Redis.from_url(self.redis_url)
            try:
                await set_team(redis, RedisKeys(self.prefix), Team(team, size=size, **policy))
                return await create_key(redis, RedisKeys(self.prefix), team)
            finally:
                await redis.aclose()

        return asyncio.run(make())

    def check_alive(self) -> None:
        """Fail, naming it, if a process of this stack has exited: one that lost its port to a
        leftover of an earlier run (a bench killed with SIGKILL leaves its children) would
        otherwise let that leftover answer, and the bench would measure a process it did not
        start."""
        for role, pid in self.pids.items():
            proc = next((p for p in self.procs if p.pid == pid), None)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"{role} (pid {pid}) exited with {proc.returncode} while the stack came up;"
                    " is a process of an earlier run still holding its port?"
                )

    def wait_ready(self, pools: set[str], within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                checks = httpx.get(
                    self.base_url + "/readyz",
                    headers={"Authorization": f"Bearer {self.admin_key}"},
                    timeout=2,
                ).json()["checks"]
                if (
                    all(checks.get(f"workers.{p}", {}).get("ok") for p in pools)
                    and checks["kafka"]["ok"]
                ):
                    time.sleep(1.0)  # a process that lost its port exits within a second
                    self.check_alive()
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # not up yet, or not a laneway ingress (then check_alive tells)
            time.sleep(0.25)
        raise TimeoutError(f"stack not ready within {within_s}s")


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, a SIGTERM (a timeout, a cancelled CI job, ``kill``) unwinds the bench as Ctrl-C
    does, so the services it started stop with it instead of holding their ports for the next
    run. Python's default for SIGTERM is to exit at once, skipping every ``finally``."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take a signal
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def services(stack: BenchStack) -> Iterator[tuple[KafkaBroker, RedisServer]]:
    """The broker (with laneway's topics) and Redis of ``stack``, on their bench ports."""
    with sigterm_unwinds():
        yield from _services(stack)


def _services(stack: BenchStack) -> Iterator[tuple[KafkaBroker, RedisServer]]:
    data = Path(tempfile.mkdtemp(prefix="laneway-bench-"))
    redis = RedisServer(port=stack.redis_port, data_dir=data / "redis")
    kafka = KafkaBroker(
        port=stack.kafka_port,
        data_dir=data / "kafka",
        heap_mb=768,
        partitions=stack.partitions,
        jvm_options=stack.jvm_options,
    )
    redis.start()
    try:
        kafka.start()
        create_topics(kafka.bootstrap, stack.topics.specs(stack.partitions))
        stack.pids.update(broker=kafka.pid or 0, redis=redis.pid or 0)
        yield kafka, redis
    finally:
        kafka.stop()
        redis.stop()
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def bench_stack(stack: BenchStack) -> Iterator[BenchStack]:
    """``services`` plus the ingress and the workers of ``stack``, each a process."""
    with services(stack):
        try:
            ingress_env = {
                "LANEWAY_PORT": str(stack.ingress_port),
                "LANEWAY_PROBE_INTERVAL_S": "0",
                **stack.ingress_admin_env,
            }
            stack.spawn("ingress", {**ingress_env, **stack.ingress_env})
            for i, worker in enumerate(stack.workers):
                stack.spawn(
                    "workers",
                    {"LANEWAY_WORKER_ID": f"bench-{i}", "LANEWAY_ENGINE": "sim", **worker},
                    role="worker"
                    if len(stack.workers) == 1
                    else f"{worker.get('LANEWAY_POOL', 'completion')} worker",
                )
            if stack.streams:
                data = tempfile.mkdtemp(prefix="laneway-bench-streams-")
                stack.spawn("streams", {"LANEWAY_STREAMS_DATA_DIR": data}, role="streams")
            stack.wait_ready({w.get("LANEWAY_POOL", "completion") for w in stack.workers})
            yield stack
        finally:
            stop_processes(stack.procs)


def document_lines(documents: Iterable[str], max_tokens: int) -> list[str]:
    """The JSONL lines of a batch job: one chat completion per document, ``doc-<i>``."""
    return [
        orjson.dumps(
            {
                "custom_id": f"doc-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "laneway-chat",
                    "messages": [{"role": "user", "content": document}],
                    "max_tokens": max_tokens,
                },
            }
        ).decode()
        for i, document in enumerate(documents)
    ]


def metric_samples(text: str, *prefixes: str) -> dict[str, float]:
    """The samples of a ``/metrics`` page whose names (labels included, as the page writes
    them: ``laneway_late_starts_total{pool="completion"}``) start with one of ``prefixes``."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(prefixes) and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def scrape(port: int, *prefixes: str) -> dict[str, float]:
    """``metric_samples`` of the ``/metrics`` page served on ``port`` of this machine."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return metric_samples(text, *prefixes)


def until_answering(
    proc: subprocess.Popen[bytes], url: str, *, within_s: float, every_s: float, what: str
) -> None:
    """Return once ``url`` answers; ``RuntimeError`` naming ``what`` if ``proc`` exits first
    or ``within_s`` passes."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            httpx.get(url, timeout=2)
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(every_s)
        else:
            return


def add_ingress_env_option(parser: argparse.ArgumentParser) -> None:
    """``--ingress-env LANEWAY_X=VALUE`` (repeatable): a setting for the bench's ingresses."""
    parser.add_argument(
        "--ingress-env",
        action="append",
        default=[],
        metavar="LANEWAY_X=VALUE",
        help="a setting for the ingress (repeatable), e.g. LANEWAY_QUOTA_LEASE_SHARE=0",
    )


def ingress_env(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    """The settings ``--ingress-env`` gave, by name; a malformed one stops the bench."""
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("LANEWAY_"):
            parser.error(f"--ingress-env {item!r}: expected LANEWAY_NAME=VALUE")
        env[name] = value
    return env
