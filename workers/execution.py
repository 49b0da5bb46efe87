"""Running one request: shield check, engine, reply chunks, one usage event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError

from laneway.errors import (
    Cancelled,
    Dropped,
    EngineError,
    EngineRejected,
    EngineUnsupported,
    Expired,
)
from laneway.metrics import COST, ERRORS, QUEUE_WAIT, TOKENS, TTFT, team_label
from laneway.retry import Backoff
from laneway.schema import MAX_USAGE_MS, Outcome, Reply, RequestEnvelope, UsageEvent
from laneway.settings import Price
from workers import metrics
from workers.cache_salt import CacheSalts
from workers.followers import serve_follower
from workers.replies import ChunkStream
from workers.reuse import Follower, Generation, ReuseRegistry
from workers.types import EngineDelta, EngineRequest

if TYPE_CHECKING:
    from workers.outbox import Outbox
    from workers.settings import WorkerSettings
    from workers.shield import CancelShield
    from workers.types import Engine

__all__ = ["RequestExecutor"]

log = logging.getLogger(__name__)


# Engine priority (lower first, as vLLM's): completion before chat before batch, and within
# a class the hi band before lo. It matters where pools share an engine that schedules by it.
_PRIORITY = {"completion": 0, "chat": 2, "batch": 4}
# Preemption counts kept at most. A count waits here while its request waits to run again, on
# this worker, also across a rebalance that gives its partition back; one whose partition
# went to another worker is never reported here, and the oldest make way.
_MAX_PREEMPTION_COUNTS = 10_000


@dataclass(slots=True)
class _Totals:
    """What the engine has reported of one request so far."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    engine_ms: float = 0.0
    finish_reason: str | None = None
    ttft_ms: float | None = None
    began: bool = False
    # Its client's part, once it turned stale while later keystrokes followed its generation
    # (type-through): the text stopped going to it, the engine ran on for them.
    withheld: bool = False
    passed_tokens: int = 0  # the completion tokens its client was sent


def _duration(ms: float) -> float:
    """A duration as a usage event holds it: within a year either way. One measured from a
    time no clock could give (a batch line's record stamped in 1970 by an old topic's
    producer) still ends its request with an answer, a settlement and a usage event."""
    return round(max(-MAX_USAGE_MS, min(MAX_USAGE_MS, ms)), 3)


class RequestExecutor:
    """Executes envelopes on one engine and reports every outcome exactly once."""

    def __init__(
        self,
        engine: Engine,
        shield: CancelShield,
        outbox: Outbox,
        *,
        worker_id: str,
        pool: str = "",
        price_of: Callable[[str], Price] | None = None,
        stream_interval: int = 1,
        on_first_output: Callable[[], None] | None = None,
        reuse: ReuseRegistry | None = None,
        reuse_hold_s: float = 0.0,
        cache_salts: CacheSalts | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        # Each team's salt of the engine's prefix cache; None: one cache for every team.
        self.cache_salts = cache_salts
        # Redis's clock (``laneway.clock``), the ingress's stamp of acceptance is on: the
        # waits and times a usage event reports are read on it, and so is its ``ts``.
        self.clock = clock
        self.shield = shield
        self.outbox = outbox
        self.worker_id = worker_id
        self.pool = pool
        self.on_first_output = on_first_output  # the engine started it: room may have changed
        self.reuse = reuse if reuse is not None else ReuseRegistry()
        self.reuse_hold_s = reuse_hold_s
        self._held: dict[str, asyncio.TimerHandle] = {}  # owner id → its abort, held
        self._aborting: set[asyncio.Task[None]] = set()
        self.price_of = price_of or (lambda _route: Price())
        self.stream_interval = stream_interval  # tokens a streamed message gathers
        # Usage events handed to the producer and not yet acknowledged, by request id.
        self.deliveries: dict[str, tuple[asyncio.Future[object], UsageEvent]] = {}
        # Requests aborted to run again later (a shared engine's batch, preempted): no
        # terminal outcome, no usage event, no settlement for the attempt.
        self.preempted: set[str] = set()
        # Of those, the ones whose partition went to another worker (``withdraw``): run again
        # there, whatever this worker hears of them meanwhile.
        self.withdrawn: set[str] = set()
        # Who asked for a preemption, told once it took effect (an abort that comes during
        # the last step finds the request ending as it would have, and it is not shed).
        self._on_preempted: dict[str, Callable[[RequestEnvelope], None]] = {}
        # Times each request was preempted so far, oldest first; its usage event says so
        # when it ends (bounded: ``_MAX_PREEMPTION_COUNTS``).
        self.preemptions: dict[str, int] = {}
        # Requests whose engine generation is under way (not yet reporting their outcome).
        self.live: set[str] = set()

    @classmethod
    def of_pool(
        cls,
        settings: WorkerSettings,
        engine: Engine,
        shield: CancelShield,
        outbox: Outbox,
        on_first_output: Callable[[], None],
        *,
        clock: Callable[[], float] = time.time,
    ) -> RequestExecutor:
        """The executor of a pool's worker, as its settings say."""
        return cls(
            engine,
            shield,
            outbox,
            reuse=ReuseRegistry(ttl_s=settings.reuse_ttl_s, max_entries=settings.reuse_max_entries),
            reuse_hold_s=settings.reuse_hold_ms / 1000,
            worker_id=settings.worker_id,
            pool=settings.pool,
            price_of=settings.price_of,
            stream_interval=settings.stream_interval,
            on_first_output=on_first_output,
            cache_salts=CacheSalts() if settings.cache_isolation else None,
            clock=clock,
        )

    async def delivered(self, request_id: str) -> None:
        """Wait until the usage event of a finished request is stored by the broker: sent
        again for as long as the broker refuses it, since its offset may not move before
        (billing, quotas and the breaker count it). A stop meanwhile leaves the offset
        pending: the request runs again, and its usage event is counted once by id."""
        pending = self.deliveries.pop(request_id, None)
        if pending is None:
            return
        delivery, usage = pending
        backoff = Backoff(0.2, 10.0)
        while True:
            try:
                await delivery
            except KafkaError as exc:
                wait = backoff.next_wait()
                log.warning(
                    "usage event of %s not stored (%s); sending it again in %.1fs",
                    request_id,
                    exc,
                    wait,
                    extra={"request_id": request_id, "team": usage.team},
                )
                await asyncio.sleep(wait)
                delivery = await self.outbox.send_usage(usage)
            else:
                return

    async def drop(self, env: RequestEnvelope, reason: Dropped) -> UsageEvent:
        """Finish a request that never reached the engine, with the reason."""
        queue_ms = max(0.0, (self.clock() - env.accepted_ts) * 1000)
        log.info(
            "dropped %s before execution: %s",
            env.id,
            reason,
            extra={"request_id": env.id, "team": env.team},
        )
        return await self.report(env, reason.status, queue_ms=queue_ms, error=str(reason))  # type: ignore[arg-type]

    async def run(self, env: RequestEnvelope) -> UsageEvent | None:
        """Run ``env`` on the engine now (the worker dispatches it when the engine has room);
        ``queue_ms`` is its wait from acceptance to this moment. None: it was preempted
        (aborted to run again later) and reported nothing."""
        queue_ms = max(0.0, (self.clock() - env.accepted_ts) * 1000)
        stale = self.shield.verdict(env, time.time())  # the deadline is on this clock
        if stale is not None and not self._starts_for_followers(env, stale):
            self._ended(env, self.reuse.of_owner(env.id), _Totals(), "dropped")
            return await self.drop(env, stale)

        # Stale, it runs for its followers only: its client is told so, as if aborted.
        self.shield.started(env, stale=stale)
        self.live.add(env.id)
        chunks = (
            ChunkStream(self.outbox.replies, env.reply_to, env.id, self.stream_interval)
            if env.stream and env.reply_to
            else None
        )
        # Reusable by later keystrokes of its session (type-through) and identical requests.
        generation = self.reuse.of_owner(env.id)
        if generation is None and env.reuse and env.messages is None:
            generation = self.reuse.begin(env)
        text_parts: list[str] = []
        # Stale from its start: its text is withheld from its own client from the first token,
        # though the followers it started for may all have left by then.
        got = _Totals(withheld=stale is not None)
        status: Outcome = "ok"
        error: str | None = None
        param: str | None = None
        requeued = False
        try:
            async for delta in self.engine.generate(self._engine_request(env)):
                self._fold(env, got, delta, generation)
                self._pass_on(
                    env,
                    delta.text,
                    got=got,
                    generation=generation,
                    chunks=chunks,
                    text_parts=text_parts,
                )
        except Dropped as dropped:
            # Shed to run again later, unless its client cancelled meanwhile (a tombstone
            # that came while the abort was under way): then this is its end. Withdrawn, it
            # ends there either way: its partition's next owner answers it.
            if env.id in self.withdrawn or (
                env.id in self.preempted
                and not isinstance(self.shield.stale_reason(env.id), Cancelled)
            ):
                requeued = True
                self._preempted(env, got, dropped, chunks)
                return None
            status, error = self._dropped(env, got, dropped)
        except EngineError as exc:
            log.warning(
                "engine error on %s: %s",
                env.id,
                exc,
                extra={"request_id": env.id, "team": env.team},
            )
            status, error = _engine_outcome(exc), str(exc)
            param = exc.param if isinstance(exc, EngineRejected) else None
        except Exception as exc:
            # An engine that fails in a way nobody foresaw still owes its client an answer,
            # the quota a settlement and the breaker an error to count.
            log.exception(
                "engine failed on %s", env.id, extra={"request_id": env.id, "team": env.team}
            )
            status, error = "error", f"the engine failed ({type(exc).__name__}: {exc})"
        except BaseException:
            if chunks is not None:
                chunks.cancel()
            raise
        finally:
            withdrawn = env.id in self.withdrawn
            stale = self.shield.stale_reason(env.id) if got.withheld else None
            stale_ms, news_ms = self._left(env, got, generation, status, requeued=requeued)
        return await self._outcome(
            env,
            status=status,
            error=error,
            got=got,
            chunks=chunks,
            text_parts=text_parts,
            queue_ms=queue_ms,
            stale=stale,
            waste=(stale_ms, news_ms),
            withdrawn=withdrawn,
            param=param,
        )

    async def _outcome(
        self,
        env: RequestEnvelope,
        *,
        status: Outcome,
        error: str | None,
        param: str | None,
        got: _Totals,
        chunks: ChunkStream | None,
        text_parts: list[str],
        queue_ms: float,
        stale: Dropped | None,
        waste: tuple[float, float],
        withdrawn: bool,
    ) -> UsageEvent | None:
        """The outcome of a run that left the engine: its final reply and usage event, or
        None when it is not this worker's to report."""
        if withdrawn:
            # Its abort came during its last step (it ended all the same) or ended it in an
            # error: its partition's next owner answers it, and this run reports nothing.
            if chunks is not None:
                chunks.cancel()
            return None
        if stale is not None:
            # Its engine request ran on (to its end, or until the last follower left) for the
            # keystrokes that typed through it, not for it: its client is told it was
            # superseded (or it left), as when aborted, not given the text cut off as a whole
            # answer; and charged what it was sent (each follower is charged the tokens it
            # received).
            if status == "ok":
                status, error = stale.status, str(stale)  # type: ignore[assignment]
            got.completion_tokens = got.passed_tokens
        n = at = 0
        if chunks is not None:
            # The rest of the text rides on the final reply.
            n, at, rest = await chunks.close()
            text_parts.append(rest)
        return await self.report(
            env,
            status,
            n=n,
            at=at,
            text="".join(text_parts),
            queue_ms=queue_ms,
            ttft_ms=got.ttft_ms,
            engine_ms=got.engine_ms,
            prompt_tokens=got.prompt_tokens,
            cached_tokens=got.cached_tokens,
            completion_tokens=got.completion_tokens,
            finish_reason=got.finish_reason,
            error=error,
            param=param,
            stale_engine_ms=waste[0],
            stale_news_ms=waste[1],
        )

    def _preempted(
        self, env: RequestEnvelope, got: _Totals, dropped: Dropped, chunks: ChunkStream | None
    ) -> None:
        """``env`` was aborted to run again later: no outcome now."""
        if chunks is not None:
            chunks.cancel()
        metrics.PREEMPTED_ENGINE_MS.labels(self.pool).inc(max(got.engine_ms, dropped.engine_ms))
        if env.id in self.withdrawn:
            return  # not preempted: it runs again on its partition's next owner
        counts = self.preemptions
        counts[env.id] = counts.pop(env.id, 0) + 1
        while len(counts) > _MAX_PREEMPTION_COUNTS:
            del counts[next(iter(counts))]
        taken = self._on_preempted.pop(env.id, None)
        if taken is not None:
            taken(env)

    def _left(
        self,
        env: RequestEnvelope,
        got: _Totals,
        generation: Generation | None,
        status: Outcome,
        *,
        requeued: bool,
    ) -> tuple[float, float]:
        """``env`` left the engine: the shield and the registries let go of it. Returns its
        stale engine ms and how long the news of its staleness took."""
        stale_ms, news_ms = self.shield.waste(env.id, got.engine_ms)
        if requeued:
            self.shield.requeued(env.id)  # a cancel while it waits still drops it
        else:
            self.shield.finished(env.id)
        self.preempted.discard(env.id)
        self.withdrawn.discard(env.id)
        self._on_preempted.pop(env.id, None)
        self.live.discard(env.id)
        if self._ended(env, generation, got, status):
            stale_ms = 0.0  # what it made after its own client left, others used
        return stale_ms, news_ms

    def _starts_for_followers(self, env: RequestEnvelope, stale: Dropped) -> bool:
        """Stale for its own client but followed by others (type-through), ``env`` starts all
        the same: a deadline is the only reason not to then."""
        followed = self.reuse.of_owner(env.id)
        wanted = followed is not None and any(not f.left for f in followed.followers.values())
        return wanted and not isinstance(stale, Expired)

    def _fold(
        self, env: RequestEnvelope, got: _Totals, delta: EngineDelta, generation: Generation | None
    ) -> None:
        if generation is not None:
            generation.add(delta.text, delta.completion_tokens, delta.engine_ms)
        got.prompt_tokens, got.cached_tokens = delta.prompt_tokens, delta.cached_tokens
        got.completion_tokens, got.engine_ms = delta.completion_tokens, delta.engine_ms
        got.finish_reason = delta.finish_reason or got.finish_reason
        if not got.began:
            got.began = True
            self._first_output(env, generation)
        if delta.text and got.ttft_ms is None:
            got.ttft_ms = (self.clock() - env.accepted_ts) * 1000
        self.shield.progress(env.id, got.completion_tokens, got.engine_ms, delta.ended)

    def _pass_on(
        self,
        env: RequestEnvelope,
        text: str,
        *,
        got: _Totals,
        generation: Generation | None,
        chunks: ChunkStream | None,
        text_parts: list[str],
    ) -> None:
        """A delta's text to its client: streamed, or kept for the final reply. None once
        its client has gone and others follow its generation (they carry the text on), or
        once it was withdrawn (its partition's next owner answers it); for good: the text
        after what its client lacks would leave a hole."""
        if (
            got.withheld
            or env.id in self.withdrawn
            or (
                generation is not None and generation.followers and self.shield.stale_reason(env.id)
            )
        ):
            got.withheld = True
            return
        got.passed_tokens = got.completion_tokens
        if chunks is not None and text:
            chunks.add(text, got.completion_tokens)
        else:
            text_parts.append(text)

    def _ended(
        self, env: RequestEnvelope, generation: Generation | None, got: _Totals, status: str
    ) -> bool:
        """Its engine request ended; whether others followed its generation."""
        held = self._held.pop(env.id, None)
        if held is not None:
            held.cancel()
        if generation is None:
            return False
        generation.end(got.finish_reason, completed=status == "ok")
        self.reuse.finished(env.id)
        # Sent text, or still to be sent some (a follower may not have woken yet); not one
        # that typed all it made, which runs on its own.
        made = len(generation.text)
        return generation.served > 0 or any(
            not f.left and f.start < made for f in generation.followers.values()
        )

    def _dropped(self, env: RequestEnvelope, got: _Totals, dropped: Dropped) -> tuple[Outcome, str]:
        """A running request that left the engine early: its outcome and why."""
        took = self.shield.abort_latency(env.id)
        if took is not None:
            metrics.ABORT_SECONDS.labels(self.pool).observe(took)
        stale = self.shield.stale_reason(env.id)
        status = stale.status if stale is not None else dropped.status
        got.engine_ms = max(got.engine_ms, dropped.engine_ms)
        return status, str(stale or dropped)  # type: ignore[return-value]

    async def abort(self, request_id: str, *, hold: bool = False) -> None:
        """Stop a request that turned stale. One that others follow (type-through) keeps its
        generation running for them; a follower just leaves it. ``hold``: a reusable
        generation of a session waits up to ``reuse_hold_s`` for the session's next
        keystroke, which may type through it (``release`` ends the wait)."""
        follower = self.reuse.follower(request_id)
        if follower is not None:
            follower.left = True
            follower.generation.wake()
            return
        generation = self.reuse.of_owner(request_id)
        if generation is not None and generation.followers:
            return
        if hold and generation is not None and generation.session and self.reuse_hold_s > 0:
            if request_id not in self._held:
                self._held[request_id] = asyncio.get_running_loop().call_later(
                    self.reuse_hold_s, self._abort_held, request_id
                )
            return
        await self._stop(request_id)

    async def _stop(self, request_id: str) -> None:
        """Abort ``request_id`` on the engine. Its generation takes no follower from now on:
        the abort lands a step (or an HTTP close) later and cuts it short, and a keystroke
        that typed through it in between would get a broken answer, not a suggestion."""
        generation = self.reuse.of_owner(request_id)
        if generation is not None:
            generation.stopping = True
        await self.engine.abort(request_id)

    async def preempt(
        self, request_id: str, *, taken: Callable[[RequestEnvelope], None] | None = None
    ) -> bool:
        """Abort a request on the engine to run it again later: it reports nothing now
        (``run`` returns None), and ``taken`` is called once that is so (an abort that comes
        during its last step may find it ending as it would have). False when it cannot be:
        not generating (not started, or reporting its outcome), preempted already, or others
        follow its generation."""
        if not self._preemptible(request_id):
            return False
        self.preempted.add(request_id)
        if taken is not None:
            self._on_preempted[request_id] = taken
        await self._stop(request_id)
        return True

    async def withdraw(self, request_id: str) -> bool:
        """Stop a request whose partition went to another worker: that worker runs it and
        answers its client, so it reports nothing here (``run`` and ``follow`` return None),
        not even a cancel that comes meanwhile. A follower leaves its generation at once; a
        request others still follow runs on for them and stops when the last leaves. False
        when it is not running or following, or withdrawn or preempted already."""
        follower = self.reuse.follower(request_id)
        if follower is not None:
            if follower.withdrawn:
                return False
            follower.withdrawn = follower.left = True
            follower.generation.wake()
            await self.leave(request_id)
            return True
        if request_id not in self.live or request_id in self.preempted:
            return False
        self.preempted.add(request_id)
        self.withdrawn.add(request_id)
        generation = self.reuse.of_owner(request_id)
        if generation is None or not generation.followers:
            await self._stop(request_id)
        return True

    def _preemptible(self, request_id: str) -> bool:
        if request_id not in self.live or request_id in self.preempted:
            return False
        generation = self.reuse.of_owner(request_id)
        return generation is None or not generation.followers

    async def release(self, env: RequestEnvelope) -> None:
        """``env`` follows nothing: a held abort of its session's generation goes ahead."""
        if env.session is None:
            return
        for rid, timer in list(self._held.items()):
            generation = self.reuse.of_owner(rid)
            if generation is None or (generation.team, generation.session) != (
                env.team,
                env.session,
            ):
                continue
            timer.cancel()
            del self._held[rid]
            if not generation.followers:
                await self._stop(rid)

    def _abort_held(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        generation = self.reuse.of_owner(request_id)
        if generation is not None and not generation.followers and not generation.done:
            generation.stopping = True  # now, not when the task runs
            task = asyncio.get_running_loop().create_task(self.engine.abort(request_id))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def follow(self, follower: Follower) -> UsageEvent | None:
        """Serve a request from a generation it did not start (``workers.followers``); None:
        it reported nothing (withdrawn, or to run on its own)."""
        return await serve_follower(self, follower)

    async def leave(self, request_id: str) -> None:
        """A follower is done; the generation it followed stops if nobody wants it now: its
        own client left (or was superseded), or its partition went to another worker."""
        generation = self.reuse.leave(request_id)
        if (
            generation is not None
            and not generation.done
            and not generation.followers
            and (
                generation.owner in self.withdrawn
                or self.shield.stale_reason(generation.owner) is not None
            )
        ):
            await self._stop(generation.owner)

    def _first_output(self, env: RequestEnvelope, generation: Generation | None) -> None:
        """The engine's first output: the request began there. Began after it turned stale
        (the news came before the engine started it) is a late start: work the shield
        should have saved, unless others follow its generation (it runs for them)."""
        followed = generation is not None and bool(generation.followers)
        if self.shield.stale_reason(env.id) is not None and not followed:
            metrics.LATE_STARTS.labels(self.pool).inc()
        if self.on_first_output is not None:
            self.on_first_output()

    def _engine_request(self, env: RequestEnvelope) -> EngineRequest:
        return EngineRequest(
            id=env.id,
            route=env.route,
            prompt=env.text_prompt(),
            max_tokens=env.max_tokens,
            messages=env.messages,
            suffix=env.suffix,
            temperature=env.temperature,
            top_p=env.top_p,
            stop=env.stop,
            priority=_PRIORITY[env.cls] + (env.band == "lo"),
            deadline_ts=env.deadline_ts,
            client_seed=env.seed,
            prompt_estimate=env.prompt_tokens,
            cache_salt=None if self.cache_salts is None else self.cache_salts.of(env.team),
        )

    async def report(
        self,
        env: RequestEnvelope,
        status: Outcome,
        *,
        n: int = 0,
        at: int = 0,
        text: str = "",
        queue_ms: float = 0.0,
        ttft_ms: float | None = None,
        engine_ms: float = 0.0,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        completion_tokens: int = 0,
        finish_reason: str | None = None,
        error: str | None = None,
        param: str | None = None,
        stale_engine_ms: float = 0.0,
        stale_news_ms: float = 0.0,
        reused_from: str | None = None,
    ) -> UsageEvent:
        """The terminal outcome of ``env``: its final reply, settlement and usage event."""
        now = self.clock()
        usage = UsageEvent(
            id=env.id,
            team=env.team,
            cls=env.cls,
            model=env.model,
            route=env.route,
            status=status,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            engine_ms=_duration(engine_ms),
            stale_engine_ms=_duration(stale_engine_ms),
            stale_news_ms=_duration(stale_news_ms),
            queue_ms=_duration(queue_ms),
            ttft_ms=_duration(ttft_ms) if ttft_ms is not None else None,
            total_ms=_duration((now - env.accepted_ts) * 1000),
            ts=now,
            worker=self.worker_id,
            error=error,
            job_id=env.job_id,
            reused_from=reused_from,
            preempted=self.preemptions.pop(env.id, 0),
            shadow=env.shadow,
            accepted_ts=env.accepted_ts,
        )
        final = Reply(
            id=env.id,
            n=n,
            at=at,
            text=text,
            done=True,
            # The same 400 to the client: an ingress from before "unsupported" would drop a
            # reply it cannot decode, and leave its client waiting for LANEWAY_REPLY_TIMEOUT_S.
            status="rejected" if status == "unsupported" else status,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            route=env.route,
            error=error,
            param=param,
        )
        delivery = await self.outbox.finish(env, final, usage)
        if delivery is not None:
            self.deliveries[env.id] = (delivery, usage)
        _record(env, usage, self.price_of(env.route))
        return usage


def _engine_outcome(exc: EngineError) -> Outcome:
    """How an engine's error ends its request. ``rejected`` (refused for what it asks) is
    counted by its team's breaker alone, never by the route's: it says nothing of the engine.
    ``unsupported`` (the engine does not have what it asks) by neither, and not charged:
    every request of a client that always sends it (an IDE's ``suffix``) would otherwise
    isolate its team."""
    if isinstance(exc, EngineUnsupported):
        return "unsupported"
    return "rejected" if isinstance(exc, EngineRejected) else "error"


def _record(env: RequestEnvelope, usage: UsageEvent, price: Price) -> None:
    team = team_label(env.team)
    metrics.OUTCOMES.labels(team, env.cls, usage.status).inc()
    metrics.ENGINE_MS.labels(team, env.cls).inc(usage.engine_ms)
    if usage.stale_engine_ms:
        metrics.STALE_ENGINE_MS.labels(team, env.cls, usage.status).inc(usage.stale_engine_ms)
    if usage.status == "error":
        ERRORS.labels("engine").inc()
    if usage.engine_ms or usage.status == "ok":
        QUEUE_WAIT.labels(team, env.cls, env.route).observe(usage.queue_ms / 1000)
    if usage.ttft_ms is not None:
        TTFT.labels(team, env.cls, env.route).observe(usage.ttft_ms / 1000)
    uncached = usage.prompt_tokens - usage.cached_tokens
    for kind, count in (
        ("prompt", uncached),
        ("cached", usage.cached_tokens),
        ("completion", usage.completion_tokens),
    ):
        if count:
            TOKENS.labels(team, env.cls, env.route, kind).inc(count)
    if env.shadow:
        return  # a shadow route's mirror is not billed: no cost
    cost = (
        uncached * price.prompt
        + usage.cached_tokens * price.cached
        + usage.completion_tokens * price.completion
    ) / 1000
    if cost:
        COST.labels(team, env.cls, env.route).inc(cost)
