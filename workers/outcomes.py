"""What a request's run on the engine comes to (``RequestExecutor.run``).

The engine's deltas are folded into the run's totals and its text passed on to its client
(or withheld, once others carry it on); when the run leaves the engine, the shield and the
registries let go of it, and it ends answered, dropped, preempted or withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from laneway.errors import Dropped, EngineError, EngineRejected, EngineUnsupported
from laneway.schema import Outcome, RequestEnvelope, UsageEvent
from workers import metrics

if TYPE_CHECKING:
    from laneway.tool_frames import CallFrames
    from workers.execution import RequestExecutor
    from workers.replies import ChunkStream
    from workers.reuse import Generation
    from workers.types import EngineDelta

__all__ = [
    "RunTotals",
    "dropped_outcome",
    "engine_outcome",
    "engine_request_ended",
    "final_outcome",
    "fold_delta",
    "framed",
    "left_engine",
    "pass_on_text",
    "preempted_run",
]


@dataclass(slots=True)
class RunTotals:
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


def fold_delta(
    executor: RequestExecutor,
    env: RequestEnvelope,
    got: RunTotals,
    delta: EngineDelta,
    generation: Generation | None,
) -> None:
    """One delta of the engine's into ``got`` (and the generation others may follow)."""
    if generation is not None:
        generation.add(delta.text, delta.completion_tokens, delta.engine_ms, delta.prompt_tokens)
    got.prompt_tokens, got.cached_tokens = delta.prompt_tokens, delta.cached_tokens
    got.completion_tokens, got.engine_ms = delta.completion_tokens, delta.engine_ms
    got.finish_reason = delta.finish_reason or got.finish_reason
    if not got.began:
        got.began = True
        _first_output(executor, env, generation)
    if (delta.text or delta.tool_parts) and got.ttft_ms is None:
        got.ttft_ms = (executor.clock() - env.accepted_ts) * 1000
    executor.shield.progress(env.id, got.completion_tokens, got.engine_ms, delta.ended)


def _first_output(
    executor: RequestExecutor, env: RequestEnvelope, generation: Generation | None
) -> None:
    """The engine's first output: the request began there. Began after it turned stale
    (the news came before the engine started it) is a late start: work the shield
    should have saved, unless others follow its generation (it runs for them)."""
    followed = generation is not None and bool(generation.followers)
    if executor.shield.stale_reason(env.id) is not None and not followed:
        metrics.LATE_STARTS.labels(executor.pool).inc()
    if executor.on_first_output is not None:
        executor.on_first_output()


def framed(frames: CallFrames, delta: EngineDelta) -> str:
    """A chat with tools: the delta's text and tool parts, framed (``laneway.tool_frames``);
    the last delta closes the calls that had no argument."""
    text = frames.text(delta.text, delta.tool_parts)
    return text + frames.end() if delta.finish_reason is not None else text


def pass_on_text(
    executor: RequestExecutor,
    env: RequestEnvelope,
    text: str,
    *,
    got: RunTotals,
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
        or env.id in executor.withdrawn
        or (
            generation is not None and generation.followers and executor.shield.stale_reason(env.id)
        )
    ):
        got.withheld = True
        return
    got.passed_tokens = got.completion_tokens
    if chunks is not None and text:
        chunks.add(text, got.completion_tokens)
    else:
        text_parts.append(text)


def preempted_run(
    executor: RequestExecutor,
    env: RequestEnvelope,
    got: RunTotals,
    dropped: Dropped,
    chunks: ChunkStream | None,
) -> None:
    """``env`` was aborted to run again later: no outcome now."""
    if chunks is not None:
        chunks.cancel()
    metrics.PREEMPTED_ENGINE_MS.labels(executor.pool).inc(max(got.engine_ms, dropped.engine_ms))
    if env.id in executor.withdrawn:
        return  # not preempted: it runs again on its partition's next owner
    executor.reports.count_preemption(env.id)
    taken = executor.on_preempted.pop(env.id, None)
    if taken is not None:
        taken(env)


def dropped_outcome(
    executor: RequestExecutor, env: RequestEnvelope, got: RunTotals, dropped: Dropped
) -> tuple[Outcome, str]:
    """A running request that left the engine early: its outcome and why."""
    took = executor.shield.abort_latency(env.id)
    if took is not None:
        metrics.ABORT_SECONDS.labels(executor.pool).observe(took)
    stale = executor.shield.stale_reason(env.id)
    status = stale.status if stale is not None else dropped.status
    got.engine_ms = max(got.engine_ms, dropped.engine_ms)
    return status, str(stale or dropped)


def engine_outcome(exc: EngineError) -> Outcome:
    """How an engine's error ends its request. ``rejected`` (refused for what it asks) is
    counted by its team's breaker alone, never by the route's: it says nothing of the engine.
    ``unsupported`` (the engine does not have what it asks) by neither, and not charged:
    every request of a client that always sends it (an IDE's ``suffix``) would otherwise
    isolate its team."""
    if isinstance(exc, EngineUnsupported):
        return "unsupported"
    return "rejected" if isinstance(exc, EngineRejected) else "error"


def left_engine(
    executor: RequestExecutor,
    env: RequestEnvelope,
    got: RunTotals,
    generation: Generation | None,
    status: Outcome,
    *,
    requeued: bool,
) -> tuple[float, float]:
    """``env`` left the engine: the shield and the registries let go of it. Returns its
    stale engine ms and how long the news of its staleness took."""
    stale_ms, news_ms = executor.shield.waste(env.id, got.engine_ms)
    if requeued:
        executor.shield.requeued(env.id)  # a cancel while it waits still drops it
    else:
        executor.shield.finished(env.id)
    executor.preempted.discard(env.id)
    executor.withdrawn.discard(env.id)
    executor.on_preempted.pop(env.id, None)
    executor.live.discard(env.id)
    if engine_request_ended(executor, env, generation, got, status):
        stale_ms = 0.0  # what it made after its own client left, others used
    return stale_ms, news_ms


def engine_request_ended(
    executor: RequestExecutor,
    env: RequestEnvelope,
    generation: Generation | None,
    got: RunTotals,
    status: str,
) -> bool:
    """Its engine request ended; whether others followed its generation."""
    held = executor.held_aborts.pop(env.id, None)
    if held is not None:
        held.cancel()
    if generation is None:
        return False
    generation.end(got.finish_reason, completed=status == "ok")
    executor.reuse.finished(env.id)
    # Sent text, or still to be sent some (a follower may not have woken yet); not one
    # that typed all it made, which runs on its own.
    made = len(generation.text)
    return generation.served > 0 or any(
        not f.left and f.start < made for f in generation.followers.values()
    )


async def final_outcome(
    executor: RequestExecutor,
    env: RequestEnvelope,
    *,
    status: Outcome,
    error: str | None,
    param: str | None,
    got: RunTotals,
    chunks: ChunkStream | None,
    text_parts: list[str],
    queue_ms: float,
    stale: Dropped | None,
    waste: tuple[float, float],
    withdrawn: bool,
    call_ids: dict[str, str] | None = None,
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
            status, error = stale.status, str(stale)
        got.completion_tokens = got.passed_tokens
    n = at = 0
    if chunks is not None:
        # The rest of the text rides on the final reply.
        n, at, rest = await chunks.close()
        text_parts.append(rest)
    return await executor.reports.report(
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
        call_ids=call_ids,
        error=error,
        param=param,
        stale_engine_ms=waste[0],
        stale_news_ms=waste[1],
    )
