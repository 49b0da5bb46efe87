"""Running one request: shield check, engine, reply chunks, one usage event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from laneway.errors import (
    Cancelled,
    Dropped,
    EngineError,
    EngineFull,
    EngineRejected,
    Expired,
)
from laneway.schema import Outcome, RequestEnvelope, UsageEvent
from laneway.settings import Price
from laneway.tool_frames import CallFrames
from workers import aborts
from workers.cache_salt import CacheSalts
from workers.followers import serve_follower
from workers.outcomes import (
    RunTotals,
    dropped_outcome,
    engine_outcome,
    engine_request_ended,
    final_outcome,
    fold_delta,
    framed,
    left_engine,
    pass_on_text,
    preempted_run,
)
from workers.replies import ChunkStream
from workers.reports import Reports
from workers.reuse import Follower, ReuseRegistry
from workers.types import EngineRequest

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
        self.pool = pool
        self.on_first_output = on_first_output  # the engine started it: room may have changed
        self.reuse = reuse if reuse is not None else ReuseRegistry()
        self.reuse_hold_s = reuse_hold_s
        self.held_aborts: dict[str, asyncio.TimerHandle] = {}  # owner id → its abort, held
        self.aborting: set[asyncio.Task[None]] = set()  # held aborts gone ahead, under way
        self.stream_interval = stream_interval  # tokens a streamed message gathers
        self.reports = Reports(outbox, worker_id=worker_id, price_of=price_of, clock=clock)
        # Requests aborted to run again later (a shared engine's batch, preempted): no
        # terminal outcome, no usage event, no settlement for the attempt.
        self.preempted: set[str] = set()
        # Of those, the ones whose partition went to another worker (``withdraw``): run again
        # there, whatever this worker hears of them meanwhile.
        self.withdrawn: set[str] = set()
        # Who asked for a preemption, told once it took effect (an abort that comes during
        # the last step finds the request ending as it would have, and it is not shed).
        self.on_preempted: dict[str, Callable[[RequestEnvelope], None]] = {}
        # Requests whose engine generation is under way (not yet reporting their outcome).
        self.live: set[str] = set()
        # Requests the engine had no room for (``EngineFull``), to queue again: how long it
        # asked the worker to send nothing more, by id.
        self.no_room: dict[str, float] = {}

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

    async def drop(self, env: RequestEnvelope, reason: Dropped) -> UsageEvent:
        """Finish a request that never reached the engine, with the reason."""
        queue_ms = max(0.0, (self.clock() - env.accepted_ts) * 1000)
        log.info(
            "dropped %s before execution: %s",
            env.id,
            reason,
            extra={"request_id": env.id, "team": env.team},
        )
        return await self.reports.report(env, reason.status, queue_ms=queue_ms, error=str(reason))

    async def run(self, env: RequestEnvelope) -> UsageEvent | None:
        """Run ``env`` on the engine now (the worker dispatches it when the engine has room);
        ``queue_ms`` is its wait from acceptance to this moment. None: it was preempted
        (aborted to run again later), or the engine had no room for it (``no_room``), and
        it reported nothing."""
        queue_ms = max(0.0, (self.clock() - env.accepted_ts) * 1000)
        stale = self.shield.verdict(env, time.time())  # the deadline is on this clock
        if stale is not None and not self._starts_for_followers(env, stale):
            engine_request_ended(self, env, self.reuse.of_owner(env.id), RunTotals(), "dropped")
            return await self.drop(env, stale)

        # Stale, it runs for its followers only: its client is told so, as if aborted.
        self.shield.started(env, stale=stale)
        self.live.add(env.id)
        # A chat with tools frames its calls in its text (``laneway.tool_frames``).
        frames = CallFrames(env.id) if env.tools else None
        chunks = self._chunks(env, frames)
        # Reusable by later keystrokes of its session (type-through) and identical requests.
        generation = self.reuse.of_owner(env.id)
        if generation is None and env.reuse and env.messages is None:
            generation = self.reuse.begin(env)
        text_parts: list[str] = []
        # Stale from its start: its text is withheld from its own client from the first token,
        # though the followers it started for may all have left by then.
        got = RunTotals(withheld=stale is not None)
        status: Outcome = "ok"
        error: str | None = None
        param: str | None = None
        requeued = False
        try:
            async for delta in self.engine.generate(self._engine_request(env)):
                fold_delta(self, env, got, delta, generation)
                pass_on_text(
                    self,
                    env,
                    delta.text if frames is None else framed(frames, delta),
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
                preempted_run(self, env, got, dropped, chunks)
                return None
            status, error = dropped_outcome(self, env, got, dropped)
        except EngineFull as exc:
            # It never started: it waits in the worker's queue again, where the shield still
            # reaches it and its deadline still holds; no outcome, no usage event now.
            log.info(
                "engine had no room for %s, queued again: %s",
                env.id,
                exc,
                extra={"request_id": env.id, "team": env.team},
            )
            requeued = True
            if chunks is not None:
                chunks.cancel()
            self.no_room[env.id] = exc.retry_after
            return None
        except EngineError as exc:
            log.warning(
                "engine error on %s: %s",
                env.id,
                exc,
                extra={"request_id": env.id, "team": env.team},
            )
            status, error = engine_outcome(exc), str(exc)
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
            stale_ms, news_ms = left_engine(self, env, got, generation, status, requeued=requeued)
        return await final_outcome(
            self,
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
            call_ids=None if frames is None else frames.ids,
        )

    def _chunks(self, env: RequestEnvelope, frames: CallFrames | None) -> ChunkStream | None:
        """Where a streamed request's text goes as it comes (None: not streamed)."""
        if not (env.stream and env.reply_to):
            return None
        ids = None if frames is None else frames.ids
        return ChunkStream(
            self.outbox.replies, env.reply_to, env.id, self.stream_interval, call_ids=ids
        )

    def _starts_for_followers(self, env: RequestEnvelope, stale: Dropped) -> bool:
        """Stale for its own client but followed by others (type-through), ``env`` starts all
        the same: a deadline is the only reason not to then."""
        followed = self.reuse.of_owner(env.id)
        wanted = followed is not None and any(not f.left for f in followed.followers.values())
        return wanted and not isinstance(stale, Expired)

    def _engine_request(self, env: RequestEnvelope) -> EngineRequest:
        return EngineRequest(
            id=env.id,
            route=env.route,
            prompt=env.text_prompt(),
            max_tokens=env.max_tokens,
            max_tokens_default=env.max_tokens_default,
            messages=env.messages,
            suffix=env.suffix,
            temperature=env.temperature,
            top_p=env.top_p,
            presence_penalty=env.presence_penalty,
            frequency_penalty=env.frequency_penalty,
            stop=env.stop,
            priority=_PRIORITY[env.cls] + (env.band == "lo"),
            deadline_ts=env.deadline_ts,
            client_seed=env.seed,
            prompt_estimate=env.prompt_tokens,
            cache_salt=None if self.cache_salts is None else self.cache_salts.of(env.team),
            tools=env.tools,
            tool_choice=env.tool_choice,
            parallel_tool_calls=env.parallel_tool_calls,
            response_format=env.response_format,
            unset=frozenset(env.unset),
        )

    async def follow(self, follower: Follower) -> UsageEvent | None:
        """Serve a request from a generation it did not start (``workers.followers``); None:
        it reported nothing (withdrawn, or to run on its own)."""
        return await serve_follower(self, follower)

    # Stopping requests early: ``workers.aborts`` says how.

    async def abort(self, request_id: str, *, hold: bool = False) -> None:
        """Stop a request that turned stale (``hold``: a moment later, for its session)."""
        await aborts.abort(self, request_id, hold=hold)

    async def preempt(
        self, request_id: str, *, taken: Callable[[RequestEnvelope], None] | None = None
    ) -> bool:
        """Abort a request on the engine to run it again later; False when it cannot be."""
        return await aborts.preempt(self, request_id, taken=taken)

    async def withdraw(self, request_id: str) -> bool:
        """Stop a request whose partition went to another worker, reporting nothing."""
        return await aborts.withdraw(self, request_id)

    async def release(self, env: RequestEnvelope) -> None:
        """``env`` follows nothing: a held abort of its session's generation goes ahead."""
        await aborts.release(self, env)

    async def leave(self, request_id: str) -> None:
        """A follower is done: the generation it followed stops if nobody wants it now."""
        await aborts.leave(self, request_id)
