"""The cancel shield: stale completions never reach the engine.

A request is stale when it was cancelled (a tombstone on ``laneway.cancel``), superseded
(a newer ``seq`` for its session was fetched: one session lives on one partition, so this
worker sees every keystroke of it in order; a lower seq accepted ``SESSION_RESTART_S`` or
more after the newest starts the session's count again) or expired (its deadline passed before it
started). Stale requests are dropped before execution; ones that turn stale while running
are aborted in the engine.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from laneway.constants import SESSION_RESEND_S, SESSION_RESTART_S
from laneway.errors import Cancelled, Dropped, Expired, Superseded
from laneway.schema import CancelRecord, RequestEnvelope

__all__ = ["CancelShield", "RunningRequest"]

# A session's last seqs kept: a client resends the one just superseded, seldom older ones.
_RECENT_SEQS = 8
_K = TypeVar("_K")
_V = TypeVar("_V")


@dataclass(slots=True)
class RunningRequest:
    team: str
    session: str | None
    seq: int | None
    grace_tokens: int
    tokens: int = 0
    engine_ms: float = 0.0  # engine time used, as of the last chunk
    progress_at: float = 0.0  # monotonic time of the last chunk (of the start before one)
    stale: Dropped | None = None
    stale_at: float = 0.0  # monotonic time the news reached this worker
    news_ms: float = 0.0  # how long the news took from the ingress to this worker
    # Engine time it had used when it turned stale; None until the step under way then ends.
    stale_since_engine_ms: float | None = None

    def mark_stale(self, reason: Dropped, now: float, news_ms: float) -> None:
        """From now on its engine time is waste; ``news_ms``: how long the news took from
        the ingress to this worker."""
        self.stale = reason
        self.stale_at = now
        self.news_ms = news_ms

    def advance(self, tokens: int, engine_ms: float, now: float) -> None:
        """A chunk arrived: the step that made it ended ``now`` having used ``engine_ms``
        (a step that ended before the news, read after it, was all useful)."""
        if self.stale is not None and self.stale_since_engine_ms is None and now > self.stale_at:
            self.stale_since_engine_ms = self._split(engine_ms, now)
        self.tokens, self.engine_ms, self.progress_at = tokens, engine_ms, now

    def wasted_ms(self, engine_ms: float, now: float) -> float:
        """Engine time used after the news, of ``engine_ms`` used in all by ``now``."""
        if self.stale is None:
            return 0.0
        since = self.stale_since_engine_ms
        if since is None:
            since = self._split(engine_ms, now)
        return max(0.0, engine_ms - since)

    def _split(self, engine_ms: float, ended: float) -> float:
        """Engine time used at the news.

        The engine reports its time once per step (prefill included), so the step under way
        when the news arrived is split: the part before the news was useful work, the rest
        is waste. The step is taken to have run for its engine time right before it
        reported (and not before the previous report): a step that reports late is split
        as exactly as one on time, and news that came before the step began makes all of it
        waste.
        """
        step_ms = engine_ms - self.engine_ms
        if step_ms <= 0:
            return self.engine_ms
        began = max(self.progress_at, ended - step_ms / 1000)
        if ended <= began:
            return self.engine_ms
        before = min(1.0, max(0.0, (self.stale_at - began) / (ended - began)))
        return self.engine_ms + step_ms * before


class CancelShield:
    """Cancel set, latest keystroke per session and the requests running on this worker.

    Memory is bounded: at most ``max_entries`` cancels and sessions are kept (oldest first
    out), and a cancel is forgotten after ``ttl_s`` or once its request has finished.
    """

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        ttl_s: float = 900.0,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        # Disabled only to measure the baseline it protects against (bench/cancel_storm.py).
        self.enabled = enabled
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        # Redis's clock (``laneway.clock``), the one the ingress stamps tombstones and
        # acceptances on: their age is read on it, so a tombstone outlives a skew of this
        # machine's clock by its whole TTL. Deadlines are not read on it: the lane moved
        # them onto this machine's clock as they came in, for ``verdict``'s ``now``.
        self._wall = wall
        # Cancels of requests not running here: request id → the teams that asked, each
        # with its expiry. Per team: another team's tombstone of the same id (honoured for
        # none of the owner's work) must not replace the owner's.
        self._cancelled: OrderedDict[str, dict[str, float]] = OrderedDict()
        # Cancelled batch jobs, by (team, job id): another team's job of the same id runs on.
        self._cancelled_jobs: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Latest seq by (team, session), with the time the ingress accepted it (Redis's
        # clock): a session is a team's own name, so one team's counter never supersedes
        # another team's keystrokes of a session of the same name.
        # With it, the session's last few seqs (``_RECENT_SEQS``): one of them sent again is
        # a resend, not a count started again.
        self._latest_seq: OrderedDict[tuple[str, str], tuple[int, float, tuple[int, ...]]] = (
            OrderedDict()
        )
        self._running: dict[str, RunningRequest] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cancelled)

    # --- inputs -------------------------------------------------------------------------

    def observe(self, env: RequestEnvelope) -> list[str]:
        """Note a fetched request; returns running requests of its session it supersedes."""
        if env.session is None or env.seq is None:
            return []
        session = (env.team, env.session)
        previous = self._latest_seq.get(session)
        if previous is not None and previous[0] >= env.seq:
            latest, accepted, recent = previous
            since = env.accepted_ts - accepted
            resent = env.seq in recent and since < SESSION_RESEND_S
            if latest > env.seq and since >= SESSION_RESTART_S and not resent:
                # The count started again: this keystroke is the session's newest. What ran
                # under the old count is left alone (its clients leaving cancels it).
                self._latest_seq[session] = (env.seq, env.accepted_ts, (env.seq,))
                self._latest_seq.move_to_end(session)
            return []
        recent = () if previous is None else previous[2][-(_RECENT_SEQS - 1) :]
        self._latest_seq[session] = (env.seq, env.accepted_ts, (*recent, env.seq))
        self._latest_seq.move_to_end(session)
        self._trim(self._latest_seq)
        to_abort = []
        for rid, run in self._running.items():
            if (
                run.session != env.session
                or run.team != env.team
                or run.seq is None
                or run.seq >= env.seq
            ):
                continue
            if run.stale is None and not (run.grace_tokens and run.tokens >= run.grace_tokens):
                reason = Superseded(f"superseded by seq {env.seq} of session {env.session}")
                run.mark_stale(reason, self._clock(), self._news_ms(env.accepted_ts))
                to_abort.append(rid)
        # Disabled: staleness is still recorded (to measure the waste) but nothing aborts.
        return to_abort if self.enabled else []

    def cancel(self, record: CancelRecord) -> str | None:
        """Note a tombstone; returns the request id if it is running here and must abort."""
        if record.id in self._finished:
            return None
        run = self._running.get(record.id)
        if run is not None:
            if run.team != record.team or run.stale is not None:
                return None
            reason = Cancelled(f"cancelled ({record.reason}) while running")
            run.mark_stale(reason, self._clock(), self._news_ms(record.ts))
            return record.id if self.enabled else None
        self._keep_tombstone(record.id, record.team, record.ts + self.ttl_s)
        return None

    def _keep_tombstone(self, request_id: str, team: str, until: float) -> None:
        """A tombstone of ``team``'s for a request not running here, kept until ``until``."""
        self._cancelled.setdefault(request_id, {})[team] = until
        self._cancelled.move_to_end(request_id)
        self._trim(self._cancelled)

    def cancel_job(self, job_id: str, team: str) -> None:
        """A batch job of ``team`` was cancelled: its lines not started yet are dropped."""
        self._cancelled_jobs[(team, job_id)] = None
        self._cancelled_jobs.move_to_end((team, job_id))
        self._trim(self._cancelled_jobs)

    # --- decisions ----------------------------------------------------------------------

    def verdict(self, env: RequestEnvelope, now: float | None = None) -> Dropped | None:
        """Why ``env`` must not run, or None when it may."""
        if not self.enabled:
            return None
        now = time.time() if now is None else now
        if env.team in self._cancelled.get(env.id, {}):
            return Cancelled("cancelled before it started")
        if env.job_id is not None and (env.team, env.job_id) in self._cancelled_jobs:
            return Cancelled(f"batch {env.job_id} was cancelled before this line started")
        if env.session is not None and env.seq is not None:
            latest = self._latest_seq.get((env.team, env.session))
            if latest is not None and latest[0] > env.seq:
                return Superseded(f"superseded by seq {latest[0]} of session {env.session}")
        if env.deadline_ts is not None and now > env.deadline_ts:
            late_ms = (now - env.deadline_ts) * 1000
            return Expired(f"deadline passed {late_ms:.0f} ms before it could start")
        return None

    def started(self, env: RequestEnvelope, stale: Dropped | None = None) -> None:
        """``env`` runs, or follows another's generation. ``stale``: why it is stale already
        (it starts for the keystrokes that follow its generation); a tombstone that came
        while it was not known here makes it stale too."""
        self._finished.pop(env.id, None)
        run = RunningRequest(
            env.team, env.session, env.seq, env.supersede_grace_tokens, progress_at=self._clock()
        )
        if stale is None and self.enabled and env.team in self._cancelled.get(env.id, {}):
            stale = Cancelled("cancelled before it started")
        if stale is not None:
            run.mark_stale(stale, run.progress_at, 0.0)  # the news came before: none waited
        self._running[env.id] = run

    def progress(
        self, request_id: str, tokens: int, engine_ms: float, ended: float | None = None
    ) -> None:
        """A chunk: its step ended at ``ended`` (this shield's clock) or, when the engine does
        not say, now."""
        run = self._running.get(request_id)
        if run is not None:
            run.advance(tokens, engine_ms, self._clock() if ended is None else ended)

    def abort_latency(self, request_id: str) -> float | None:
        """Seconds from the news of a running request's staleness to now (its engine
        stopped), or None when it did not turn stale."""
        run = self._running.get(request_id)
        if run is None or run.stale is None:
            return None
        return max(0.0, self._clock() - run.stale_at)

    def stale_reason(self, request_id: str) -> Dropped | None:
        run = self._running.get(request_id)
        return run.stale if run is not None else None

    def waste(self, request_id: str, engine_ms: float) -> tuple[float, float]:
        """Engine time a running request used after it turned stale (the waste), and how
        long the news of it took to get here (0 when it never turned stale)."""
        run = self._running.get(request_id)
        if run is None or run.stale is None:
            return 0.0, 0.0
        return run.wasted_ms(engine_ms, self._clock()), run.news_ms

    def _news_ms(self, sent_ts: float) -> float:
        """Milliseconds since ``sent_ts`` (Redis's clock)."""
        return max(0.0, (self._wall() - sent_ts) * 1000)

    def requeued(self, request_id: str) -> None:
        """Its run stopped to start again later (preempted, or the engine had no room): it is
        not running, and it is not finished either, so a tombstone that comes while it waits
        is kept for its next start, and so is one that came while it ran (kept running for
        the followers it started for, it is about to be queued again)."""
        run = self._running.pop(request_id, None)
        if run is not None and isinstance(run.stale, Cancelled):
            self._keep_tombstone(request_id, run.team, self._wall() + self.ttl_s)

    def finished(self, request_id: str, now: float | None = None) -> None:
        now = self._wall() if now is None else now
        self._running.pop(request_id, None)
        self._cancelled.pop(request_id, None)
        # Remember finished ids briefly so a late tombstone is not kept for the full TTL.
        self._finished[request_id] = now
        self._trim(self._finished)
        self.expire(now)

    def expire(self, now: float | None = None) -> None:
        """Forget tombstones past their TTL and finished ids past a minute (``now``: Redis's
        clock, as the tombstones' stamps)."""
        now = self._wall() if now is None else now
        while self._cancelled:
            rid, teams = next(iter(self._cancelled.items()))
            if max(teams.values()) > now:
                break
            del self._cancelled[rid]
        horizon = now - 60.0
        while self._finished:
            rid, at = next(iter(self._finished.items()))
            if at > horizon:
                break
            del self._finished[rid]

    def _trim(self, entries: OrderedDict[_K, _V]) -> None:
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
