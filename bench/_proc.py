"""What /proc says while a bench runs: the CPU time of the stack's processes and the broker's
threads, the machine's steal, and which machine it is."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from bench._stack import BenchStack
from bench._stats import cpu_share, steal_percent


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


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and every process below it (LiteLLM's workers are children).
    ``ProcessLookupError`` if ``pid`` itself is gone: a child that exits takes its time with
    it, but the root's is the measure, and 0 for it would read as a negative window."""
    if not Path(f"/proc/{pid}/stat").exists():
        raise ProcessLookupError(f"process {pid} is gone")
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            total += stat_cpu_seconds(Path(f"/proc/{current}/stat").read_text())
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except (OSError, IndexError, ValueError):
            continue
    return total


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat): user, nice, system, idle, ..., steal."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return [0] * 8


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
    """'N cores, <cpu model>, Python <version>', as the header of every bench names it."""
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, Python {sys.version.split()[0]}"
