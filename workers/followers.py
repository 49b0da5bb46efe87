"""Serving a request from a generation it did not start (``workers.reuse``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from laneway.schema import Outcome, UsageEvent
from workers import metrics
from workers.replies import ChunkStream

if TYPE_CHECKING:
    from workers.execution import RequestExecutor
    from workers.reuse import Follower

__all__ = ["serve_follower"]


async def _deliver(
    follower: Follower,
    first_token: int,
    chunks: ChunkStream | None,
    clock: Callable[[], float],
) -> tuple[int, float | None, bool, list[str]]:
    """Pass the generation's text on until it ends, the follower leaves or reaches its own
    max_tokens; returns where it got to, its time to first text, whether it was capped, and
    the text not streamed."""
    env, generation = follower.env, follower.generation
    # No more than its own max_tokens of the generation's tokens past its start.
    last = first_token + env.max_tokens
    parts: list[str] = []
    at = follower.start
    ttft_ms: float | None = None
    capped = False
    while not follower.left:
        changed = generation.changed
        end = len(generation.text)
        if generation.tokens >= last:
            end, capped = generation.ends[last - 1], True
        if end > at:
            text = generation.text[at:end]
            at = end
            if ttft_ms is None:
                ttft_ms = (clock() - env.accepted_ts) * 1000
            if chunks is not None:
                chunks.add(text, generation.tokens_within(at) - first_token)
            else:
                parts.append(text)
        if capped or generation.done:
            break
        await changed.wait()
    return at, ttft_ms, capped, parts


async def serve_follower(executor: RequestExecutor, follower: Follower) -> UsageEvent:
    """Send ``follower`` what its generation made past the text it typed, at once, then the
    rest as it comes; report it ``ok`` with no engine time and the tokens it received."""
    env, generation = follower.env, follower.generation
    started = executor.clock()  # Redis's, as the acceptance's stamp
    chunks = (
        ChunkStream(executor.outbox.replies, env.reply_to, env.id, executor.stream_interval)
        if env.stream and env.reply_to
        else None
    )
    first_token = generation.tokens_within(follower.start)
    try:
        at, ttft_ms, capped, parts = await _deliver(follower, first_token, chunks, executor.clock)
    except BaseException:
        if chunks is not None:
            chunks.cancel()
        raise
    finally:
        await executor.leave(env.id)
    tokens = generation.tokens_within(at) - first_token
    stale = executor.shield.stale_reason(env.id)
    executor.shield.finished(env.id)
    status: Outcome = "ok"
    error = None
    if stale is not None:
        status, error = stale.status, str(stale)  # type: ignore[assignment]
    elif generation.finish_reason is None and not capped:
        status, error = "error", f"the generation of {generation.owner} it followed ended early"
    n = sent = 0
    if chunks is not None:
        n, sent, rest = await chunks.close()
        parts.append(rest)
    per_token = generation.engine_ms / generation.tokens if generation.tokens else 0.0
    metrics.REUSED.labels(executor.pool, follower.kind).inc()
    metrics.REUSE_SAVED_MS.labels(executor.pool).inc(per_token * tokens)
    return await executor.report(
        env,
        status,
        n=n,
        at=sent,
        text="".join(parts),
        queue_ms=max(0.0, (started - env.accepted_ts) * 1000),
        ttft_ms=ttft_ms,
        prompt_tokens=env.prompt_tokens,
        completion_tokens=tokens,
        finish_reason="length" if capped else generation.finish_reason,
        error=error,
        reused_from=generation.owner,
    )
