"""Serving a request from a generation it did not start (``workers.reuse``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from laneway.schema import Outcome, UsageEvent
from workers import metrics
from workers.replies import ChunkStream

if TYPE_CHECKING:
    from workers.execution import RequestExecutor
    from workers.reuse import Follower, Generation

__all__ = ["serve_follower"]

# How long a follower that took its generation's last token waits for the generation's end
# (the engine's last message, a few milliseconds after that token).
_GENERATION_END_WAIT_S = 1.0


async def _deliver(
    follower: Follower,
    first_token: int,
    chunks: ChunkStream | None,
    clock: Callable[[], float],
    progress: Callable[[int], None],
) -> tuple[int, float | None, bool, list[str]]:
    """Pass the generation's text on until it ends, the follower leaves or reaches its own
    max_tokens; returns where it got to, its time to first text, whether it was capped, and
    the text not streamed. ``progress``: the tokens it received so far, as they grow."""
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
                generation.served += 1  # not at the match: one sent nothing used nothing
            tokens = generation.tokens_within(at) - first_token
            if chunks is not None:
                chunks.add(text, tokens)
            else:
                parts.append(text)
            progress(tokens)
        if capped or generation.done:
            break
        await changed.wait()
    return at, ttft_ms, capped, parts


async def serve_follower(executor: RequestExecutor, follower: Follower) -> UsageEvent | None:
    """Send ``follower`` what its generation made past the text it typed, at once, then the
    rest as it comes; report it ``ok`` with no engine time and the tokens it received. None:
    it reported nothing, withdrawn (``RequestExecutor.withdraw``) or to run on its own (its
    generation ended with nothing for it)."""
    env, generation = follower.env, follower.generation
    shield = executor.shield
    started = executor.clock()  # Redis's, as the acceptance's stamp
    chunks = (
        ChunkStream(executor.outbox.replies, env.reply_to, env.id, executor.stream_interval)
        if env.stream and env.reply_to
        else None
    )
    first_token = generation.tokens_within(follower.start)

    def progress(tokens: int) -> None:
        # As an engine run's chunks do: its team's supersede grace counts what it streamed.
        shield.progress(env.id, tokens, 0.0)

    try:
        at, ttft_ms, capped, parts = await _deliver(
            follower, first_token, chunks, executor.clock, progress
        )
    except BaseException:
        if chunks is not None:
            chunks.cancel()
        raise
    finally:
        await executor.leave(env.id)
    if capped and generation.max_tokens and generation.tokens >= generation.max_tokens:
        # It took the generation's last token, whose end (with the engine's count of the
        # prompt, and why it stopped) comes right after it: billed and told as the run is.
        await _ended(generation, _GENERATION_END_WAIT_S)
    stale = shield.stale_reason(env.id)
    if follower.withdrawn or (stale is None and _left_nothing(follower, at)):
        if chunks is not None:
            chunks.cancel()
        shield.requeued(env.id)  # not finished: a tombstone while it waits still counts
        return None
    tokens = generation.tokens_within(at) - first_token
    shield.finished(env.id)
    status: Outcome = "ok"
    error = None
    if stale is not None:
        status, error = stale.status, str(stale)
    elif generation.finish_reason is None and not capped:
        status, error = "error", f"the generation of {generation.owner} it followed ended early"
    n = sent = 0
    if chunks is not None:
        n, sent, rest = await chunks.close()
        parts.append(rest)
    per_token = generation.engine_ms / generation.tokens if generation.tokens else 0.0
    metrics.REUSED.labels(executor.pool, follower.kind).inc()
    metrics.REUSE_SAVED_MS.labels(executor.pool).inc(per_token * tokens)
    return await executor.reports.report(
        env,
        status,
        n=n,
        at=sent,
        text="".join(parts),
        queue_ms=max(0.0, (started - env.accepted_ts) * 1000),
        ttft_ms=ttft_ms,
        prompt_tokens=generation.prompt_tokens_of(env),
        completion_tokens=tokens,
        finish_reason=_finish_reason(follower, capped, first_token),
        error=error,
        reused_from=generation.owner,
    )


async def _ended(generation: Generation, within_s: float) -> None:
    """Until ``generation`` ends, ``within_s`` at most."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + within_s
    while not generation.done and (left := give_up_at - loop.time()) > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(generation.changed.wait(), left)


def _finish_reason(follower: Follower, capped: bool, first_token: int) -> str | None:
    """Why its answer ended. Capped at its own max_tokens, that is ``length``, unless its
    last token was the generation's last and the generation stopped there (a stop string
    or the end of text): its own run would have stopped on it too, and an engine says
    ``stop`` when both come at once (vLLM checks stops before the length)."""
    generation = follower.generation
    last = first_token + follower.env.max_tokens
    if not capped:
        return generation.finish_reason
    if generation.done and generation.tokens == last and generation.finish_reason == "stop":
        return "stop"
    return "length"


def _left_nothing(follower: Follower, at: int) -> bool:
    """Its generation ended and gave it no text: it runs on its own. A keystroke that typed
    all the suggestion made wants a fresh one, not an empty answer; one that followed a
    generation cut short before anything came for it is not broken (nothing went out). An
    empty answer to the very prompt the generation was asked stands."""
    generation = follower.generation
    if at > follower.start or not generation.done:
        return False
    return follower.start > 0 or generation.finish_reason is None
