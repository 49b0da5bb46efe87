"""What a request that ended tells, once: its final reply, settlement and usage event.

Its offset may not move before the broker stores the usage event (billing, quotas and the
breaker count it), so the event's delivery is kept until the worker has seen it stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiokafka.errors import KafkaError

from laneway.metrics import COST, ERRORS, QUEUE_WAIT, TOKENS, TTFT, team_label
from laneway.retry import Backoff
from laneway.schema import MAX_USAGE_MS, Outcome, Reply, RequestEnvelope, UsageEvent
from laneway.settings import Price
from workers import metrics

if TYPE_CHECKING:
    from workers.outbox import Outbox

__all__ = ["Reports"]

log = logging.getLogger(__name__)

# Preemption counts kept at most. A count waits here while its request waits to run again, on
# this worker, also across a rebalance that gives its partition back; one whose partition
# went to another worker is never reported here, and the oldest make way.
_MAX_PREEMPTION_COUNTS = 10_000


class Reports:
    """Reports each request's terminal outcome through the outbox, and sees its usage event
    stored."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        worker_id: str,
        price_of: Callable[[str], Price] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.outbox = outbox
        self.worker_id = worker_id
        self.price_of = price_of or (lambda _route: Price())
        # Redis's clock (``laneway.clock``), the ingress's stamp of acceptance is on: the
        # waits and times a usage event reports are read on it, and so is its ``ts``.
        self.clock = clock
        # Usage events handed to the producer and not yet acknowledged, by request id.
        self.deliveries: dict[str, tuple[asyncio.Future[object], UsageEvent]] = {}
        # Times each request was preempted so far, oldest first; its usage event says so
        # when it ends (bounded: ``_MAX_PREEMPTION_COUNTS``).
        self.preemptions: dict[str, int] = {}

    def count_preemption(self, request_id: str) -> None:
        """``request_id`` was preempted once more: its usage event will say so."""
        counts = self.preemptions
        counts[request_id] = counts.pop(request_id, 0) + 1
        while len(counts) > _MAX_PREEMPTION_COUNTS:
            del counts[next(iter(counts))]

    async def delivered(self, request_id: str) -> None:
        """Wait until the usage event of a finished request is stored by the broker: sent
        again for as long as the broker refuses it, since its offset may not move before
        (billing, quotas and the breaker count it); then Redis need not hold it. A stop
        meanwhile leaves the offset pending: the partition's next owner sends the event
        Redis holds (``Outbox.held_usage``), or runs the request again without one, and
        the event is counted once by id."""
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
                self.outbox.release(request_id)
                return

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
        call_ids: dict[str, str] | None = None,
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
            # An upstream's count, kept within the prompt's (the streams app refuses more).
            cached_tokens=min(cached_tokens, prompt_tokens),
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
            call_ids=call_ids or None,
        )
        delivery = await self.outbox.finish(env, final, usage)
        if delivery is not None:
            self.deliveries[env.id] = (delivery, usage)
        _record(env, usage, self.price_of(env.route))
        return usage


def _duration(ms: float) -> float:
    """A duration as a usage event holds it: within a year either way. One measured from a
    time no clock could give (a batch line's record stamped in 1970 by an old topic's
    producer) still ends its request with an answer, a settlement and a usage event."""
    return round(max(-MAX_USAGE_MS, min(MAX_USAGE_MS, ms)), 3)


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
