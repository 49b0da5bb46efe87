"""Keep ``laneway up`` serving when one of its processes dies.

The supervisor starts its processes in order and restarts one that exits with exponential
backoff and jitter, while the rest keep running. A process that keeps crashing
(``crash_limit`` exits within ``crash_window_s``) stops the stack with its last log lines.
An exit caused by a server it needs going away (Kafka, Redis) is not held against it: it is
restarted once that server is back. A process that gives signs of life (its watchdog file)
and gives none for ``hang_timeout_s`` is killed as hung, and restarted as if it had crashed.
The first stop request stops everything in waves: the front door (the ingress, which
finishes its open requests), then the other services, then the servers they need one by one
in reverse; a second kills what still runs at once.
Standby processes (a pool's replicas above its minimum) start only when ``activate``d and
stop for good when ``park``ed (the local autoscaler's two levers).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence

from laneway.errors import ConfigError, ServiceError
from ops.hang_watch import HangWatch
from ops.restart_policy import CrashLoop, RestartPolicy
from ops.supervised import Supervised
from ops.supervisor_metrics import SupervisorMetrics

__all__ = ["Supervisor", "describe_exit"]

log = logging.getLogger(__name__)


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _not_counted(need: str, ago: float) -> str:
    return f" (not counted as a crash: {need}, which it needs, went down {ago:.0f}s ago)"


class Supervisor:
    """Runs ``processes`` (started in this order) until asked to stop or one crash-loops;
    with ``hang_timeout_s`` (0: off), kills one whose watchdog file stood still that long."""

    def __init__(
        self,
        processes: Sequence[Supervised],
        policy: RestartPolicy,
        *,
        metrics: SupervisorMetrics | None = None,
        grace_s: float = 15.0,
        standby: Collection[str] = (),
        hang_timeout_s: float = 0.0,
    ) -> None:
        names = [p.name for p in processes]
        unknown = {need for p in processes for need in p.needs} - set(names)
        unknown |= set(standby) - set(names)
        if len(set(names)) != len(names) or unknown:
            raise ConfigError(
                f"processes {names} must have unique names; needs or standby names that are "
                f"none of them: {sorted(unknown)}"
            )
        self.processes = list(processes)
        self.policy = policy
        self.metrics = metrics or SupervisorMetrics()
        for name in names:
            self.metrics.restarts.labels(name)  # 0 from the start, not absent
        self.grace_s = grace_s
        self.hang_timeout_s = hang_timeout_s
        self._up = {name: asyncio.Event() for name in names}
        self._starts = dict.fromkeys(names, 0)
        self._started_with: dict[str, dict[str, int]] = {name: {} for name in names}
        self._exits: dict[str, deque[float]] = {name: deque() for name in names}
        self._went_down: dict[str, float] = {}
        self._pending_starts: set[asyncio.Future[None]] = set()
        self._stop = asyncio.Event()
        self._stop_requests = 0
        self._parked = set(standby)
        self._by_name = {p.name: p for p in self.processes}
        self._watchers: list[asyncio.Task[None]] = []
        self._kill = False
        self._failure: CrashLoop | None = None
        self._hangs = HangWatch(self)

    def restarts(self, name: str) -> int:
        """How often ``name`` was restarted so far."""
        return max(self._starts[name] - 1, 0)

    def is_up(self, name: str) -> bool:
        return self._up[name].is_set()

    def is_parked(self, name: str) -> bool:
        return name in self._parked

    async def activate(self, name: str) -> bool:
        """Start a standby process and supervise it from now on; False when the stack is
        stopping or it runs already."""
        if self._stop.is_set() or name not in self._parked:
            return False
        self._parked.discard(name)
        process = self._by_name[name]
        try:
            await self._start(process)
        except BaseException:
            self._parked.add(name)  # a standby still, for the next try
            raise
        self._watchers.append(asyncio.create_task(self._watch(process), name=name))
        log.info("started %s (pid %s)", name, process.pid)
        return True

    async def park(self, name: str) -> bool:
        """Stop a process for good (SIGTERM: it finishes what it runs); no restart follows.
        False when it was parked already."""
        if name in self._parked:
            return False
        self._parked.add(name)
        process = self._by_name[name]
        try:
            await process.stop(self.grace_s)
        except (OSError, ServiceError) as exc:
            log.warning("stopping %s: %s", name, exc)
        self._set_up(process, up=False)
        log.info("stopped %s", name)
        return True

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked for (or a crash loop began one)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """First call: stop everything in order. Second call, or a first while the stack
        already stops by itself (a crash loop): kill what still runs, now."""
        self._stop_requests += 1
        if self._stop_requests == 1 and not self._stop.is_set():
            log.warning("stopping laneway (again to kill it at once)")
            self._stop.set()
        elif not self._kill:
            log.warning("killing every process of laneway now")
            self._kill = True
            for process in self.processes:
                process.kill()

    async def run(self, on_started: Callable[[], None] | None = None) -> None:
        """Start every process, call ``on_started``, supervise until stopped.

        Raises ``CrashLoop`` if a process kept crashing, or the error of a first start.
        """
        starting = asyncio.create_task(self._start_in_order())
        stopped = asyncio.create_task(self._stop.wait())
        if self.hang_timeout_s > 0:
            self._watchers.append(asyncio.create_task(self._hangs.run(), name="hangs"))
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # a first start that failed stops everything and says why
                if on_started is not None:
                    on_started()
                await stopped
        finally:
            self._stop.set()
            # Nothing may start once the shutdown begins; starts already under way are waited
            # for there.
            tasks = (starting, stopped, *self._watchers)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()
        if self._failure is not None:
            raise self._failure

    async def _start_in_order(self) -> None:
        for process in self.processes:
            if process.name in self._parked:
                continue
            await self._start(process)
            self._watchers.append(asyncio.create_task(self._watch(process), name=process.name))

    async def _start(self, process: Supervised) -> None:
        # A start on a thread (Kafka, Redis) cannot be cancelled; the shutdown waits for it.
        start = asyncio.ensure_future(process.start())
        self._pending_starts.add(start)
        try:
            await asyncio.shield(start)
        finally:
            if start.done():
                self._pending_starts.discard(start)
        self._starts[process.name] += 1
        self._started_with[process.name] = {need: self._starts[need] for need in process.needs}
        self._hangs.started(process)
        self._set_up(process, up=True)

    def _set_up(self, process: Supervised, *, up: bool) -> None:
        event = self._up[process.name]
        event.set() if up else event.clear()
        self.metrics.up.labels(process.name).set(1 if up else 0)

    async def _watch(self, process: Supervised) -> None:
        while True:
            code = await process.wait()
            silent = self._hangs.killed_as_hung(process.name)
            if self._stop.is_set() or process.name in self._parked:
                return
            self._set_up(process, up=False)
            self._went_down[process.name] = time.monotonic()
            why = describe_exit(code)
            if silent is not None:
                why = f"hung (no sign of life for {silent:.0f}s, LANEWAY_HANG_TIMEOUT_S), {why}"
            while True:
                delay = self._count_exit(process, why)
                if delay is None or not await self._until_restart_due(process, delay):
                    return
                try:
                    await self._start(process)
                except Exception as exc:  # noqa: BLE001 - any failed start is counted
                    # Whatever the start raised (a Kafka client's error creating the topics
                    # on a broker that came up, not only ours): counted as an exit and tried
                    # again, or the stack stops on it. Before, it ended this watch unsaid, and
                    # the process was never restarted again.
                    said = str(exc) if isinstance(exc, ServiceError) else repr(exc)
                    why = f"could not start again: {said}"
                    continue
                self.metrics.restarts.labels(process.name).inc()
                log.warning(
                    "restarted %s (pid %s; restart %d)",
                    process.name,
                    process.pid,
                    self.restarts(process.name),
                )
                break

    def _count_exit(self, process: Supervised, why: str) -> float | None:
        """Record an exit; the wait before its restart, or None if the stack must stop."""
        now = time.monotonic()
        exits = self._exits[process.name]
        collateral = self._lost_a_need(process, now)
        if collateral is None:
            exits.append(now)
        while exits and exits[0] < now - self.policy.crash_window_s:
            exits.popleft()
        if len(exits) >= self.policy.crash_limit:
            self._failure = CrashLoop(
                f"{process.name} exited {len(exits)} times within "
                f"{self.policy.crash_window_s:g}s (LANEWAY_CRASH_LIMIT, LANEWAY_CRASH_WINDOW_S), "
                f"the last time: {why}; stopping the stack. "
                f"Last lines of {process.log_path}:\n{process.log_tail()}",
                process=process.name,
                exits=len(exits),
            )
            log.error("%s keeps crashing (%s); stopping the stack", process.name, why)
            self._stop.set()
            return None
        delay = self.policy.delay(len(exits))
        log.warning(
            "%s (pid %s) exited: %s%s; restarting it in %.1fs",
            process.name,
            process.pid,
            why,
            "" if collateral is None else _not_counted(*collateral),
            delay,
        )
        return delay

    def _lost_a_need(self, process: Supervised, now: float) -> tuple[str, float] | None:
        """A server ``process`` needs that is down, or went down since ``process`` started
        and less than a crash window ago, and how long ago (an exit it may have caused)."""
        started_with = self._started_with[process.name]
        for need in process.needs:
            ago = now - self._went_down.get(need, now)
            if not self.is_up(need) or (
                self._starts[need] != started_with.get(need) and ago < self.policy.crash_window_s
            ):
                return need, ago
        return None

    async def _until_restart_due(self, process: Supervised, delay: float) -> bool:
        """Wait ``delay``, then until what ``process`` needs is up; False if stopped first."""
        if await self._unless_stopped(asyncio.sleep(delay)):
            for need in process.needs:
                if not await self._unless_stopped(self._up[need].wait()):
                    return False
        return not self._stop.is_set() and process.name not in self._parked

    async def _unless_stopped(self, waiting: Awaitable[object]) -> bool:
        task = asyncio.ensure_future(waiting)
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (task, stopped):
            pending.cancel()
        return not self._stop.is_set()

    async def _shutdown(self) -> None:
        waves = self.stop_waves()
        await self._stop_in_waves(waves)
        # A start still running on a thread may spawn its process after the stop above.
        if self._pending_starts:
            await asyncio.gather(*self._pending_starts, return_exceptions=True)
            await self._stop_in_waves(waves)
        for process in self.processes:
            self._set_up(process, up=False)

    def stop_waves(self) -> list[list[Supervised]]:
        """The order of a stop: the front door (it finishes its open requests while the
        services that answer them still run), the other services together, then each server
        alone, in reverse start order."""
        needed = {need for p in self.processes for need in p.needs}
        services = [p for p in self.processes if p.name not in needed]
        servers = [[p] for p in reversed(self.processes) if p.name in needed]
        front = [p for p in services if p.front]
        return [front, [p for p in services if not p.front], *servers]

    async def _stop_in_waves(self, waves: list[list[Supervised]]) -> None:
        for wave in waves:
            await asyncio.gather(*(self._stop_one(p) for p in wave))

    async def _stop_one(self, process: Supervised) -> None:
        if self._kill:
            process.kill()  # the stop below then only reaps it
        try:
            await process.stop(self.grace_s)
        except (OSError, ServiceError) as exc:
            log.warning("stopping %s: %s", process.name, exc)
