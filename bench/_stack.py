"""A throwaway laneway stack for benchmarks: real Kafka, Redis, ingress and worker processes.

Ports default to a range of their own (31xxx) so a bench runs beside `make up` and the tests,
and below the kernel's ephemeral range (32768 and up): a client that reconnects to a port in
that range while its server is down can be given that very port as its own and connect to
itself, and the port then stays taken (TIME_WAIT) for a minute after.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
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
from laneway.devstack import KafkaBroker, RedisServer, create_topics, stop_processes
from laneway.settings import CommonSettings
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

    def wait_ready(self, pools: set[str], within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                checks = httpx.get(self.base_url + "/readyz", timeout=2).json()["checks"]
                if (
                    all(checks.get(f"workers.{p}", {}).get("ok") for p in pools)
                    and checks["kafka"]["ok"]
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"stack not ready within {within_s}s")


@contextmanager
def services(stack: BenchStack) -> Iterator[tuple[KafkaBroker, RedisServer]]:
    """The broker (with laneway's topics) and Redis of ``stack``, on their bench ports."""
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
            ingress_env = {"LANEWAY_PORT": str(stack.ingress_port), "LANEWAY_PROBE_INTERVAL_S": "0"}
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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def stat_cpu_seconds(stat: str) -> float:
    """CPU time (user + system) in the text of a /proc/<pid>[/task/<tid>]/stat file."""
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far, by role."""
    used = {}
    for role, pid in pids.items():
        try:
            used[role] = stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, IndexError):
            continue
    return used


def cpu_share(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """'role N%' per process: its share of one core between two ``cpu_seconds()``."""
    seconds = max(seconds, 1e-9)
    return "  ".join(
        f"{role} {100 * (after[role] - before.get(role, 0.0)) / seconds:.0f}%" for role in after
    )


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat): user, nice, system, idle, ..., steal."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return [0] * 8


def steal_percent(before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor gave to other guests between two ``cpu_times()``.

    On a shared virtual machine this swings from 0 to 30 % from one minute to the next, and
    every latency tail with it: a row measured under steal is not comparable to one without.
    """
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent)
    return 100 * spent[7] / total if total else 0.0


# The broker's threads that show in a latency tail, by the start of their names: the JIT
# compilers, the request-handling data plane, and ZGC's (ZWorker, ZDriver, ...).
BROKER_THREADS = (
    ("C2 Compiler", "C2 JIT"),
    ("C1 Compiler", "C1 JIT"),
    ("data-plane", "data plane"),
    ("Z", "ZGC"),
)


def thread_seconds(pid: int) -> dict[tuple[str, str], float]:
    """CPU seconds used so far by each thread of ``pid``, keyed by (thread id, group of
    ``BROKER_THREADS``, or "other")."""
    used: dict[tuple[str, str], float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return used  # the process ended
    for task in tasks:
        try:
            raw = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        group = next(
            (label for prefix, label in BROKER_THREADS if name.startswith(prefix)), "other"
        )
        used[task.name, group] = stat_cpu_seconds(raw)
    return used


def group_seconds(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> defaultdict[str, float]:
    """CPU seconds per group between two ``thread_seconds``. The JVM starts and ends threads
    as it needs them; a thread that ended in between loses its last part (an undercount)."""
    spent: defaultdict[str, float] = defaultdict(float)
    for (tid, group), seconds in after.items():
        spent[group] += seconds - before.get((tid, group), 0.0)
    return spent


def bunches(
    sent_s: list[float], latencies: list[float], over_ms: float, gap_s: float = 0.05
) -> list[int]:
    """Sizes of the bunches in which requests slower than ``over_ms`` came, largest first: a
    slow request sent within ``gap_s`` of the previous slow one joins its bunch. Many small
    bunches are requests slowed one by one; a few large ones are stalls (a collector cycle,
    a compiler burst, the hypervisor), each slowing every request that crossed it."""
    sizes: list[int] = []
    last = -1.0
    for sent, latency in sorted(zip(sent_s, latencies, strict=True)):
        if latency <= over_ms:
            continue
        if sizes and sent - last < gap_s:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = sent
    return sorted(sizes, reverse=True)


class CpuWatch:
    """The share of a core each process of ``stack`` (and this load generator) used while
    the block ran, as ``shares`` ('role N%' per process)."""

    def __init__(self, stack: BenchStack) -> None:
        self.pids = {**stack.pids, "load generator": os.getpid()}
        self.shares = ""
        self._before: dict[str, float] = {}
        self._started = 0.0

    def __enter__(self) -> CpuWatch:
        self._before, self._started = cpu_seconds(self.pids), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self._started
        self.shares = cpu_share(self._before, cpu_seconds(self.pids), elapsed)


class StealWatch:
    """Steal while a row runs: on ``average``, and in its worst short window (``peak``).

    A row's average hides bursts: 2 % of steal over ten seconds can be a few 200 ms windows
    in which the hypervisor took a third of the machine, and the slow requests of the row
    are sent in those windows.
    """

    def __init__(self, window_s: float = 0.2) -> None:
        self.window_s = window_s
        self.average = self.peak = 0.0
        self._first: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="steal-watch", daemon=True)

    def __enter__(self) -> StealWatch:
        self._first = cpu_times()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.average = steal_percent(self._first, cpu_times())

    def _watch(self) -> None:
        before = self._first
        while not self._stop.wait(self.window_s):
            after = cpu_times()
            self.peak = max(self.peak, steal_percent(before, after))
            before = after


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, Python {sys.version.split()[0]}"
