"""Stopping a request on the engine before it ends (``RequestExecutor``'s aborts).

Stale (a cancel, a newer keystroke, a deadline), preempted to run again later (memory, the
fleet's batch share), or withdrawn (its partition went to another worker). A generation that
others follow (type-through) runs on for them, and stops when the last of them leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from laneway.schema import RequestEnvelope

if TYPE_CHECKING:
    from workers.execution import RequestExecutor

__all__ = ["abort", "leave", "preempt", "release", "withdraw"]


async def abort(executor: RequestExecutor, request_id: str, *, hold: bool = False) -> None:
    """Stop a request that turned stale. One that others follow (type-through) keeps its
    generation running for them; a follower just leaves it. ``hold``: a reusable
    generation of a session that its client has shown waits up to ``reuse_hold_s`` for the
    session's next keystroke, which may type through it (``release`` ends the wait). One
    not shown (no text yet, or not streamed) stops at once: no keystroke types what the
    user never saw, and a hold before its first token would let the engine start work
    nobody wants (a late start, docs/type-through.md)."""
    follower = executor.reuse.follower(request_id)
    if follower is not None:
        follower.left = True
        follower.generation.wake()
        return
    generation = executor.reuse.of_owner(request_id)
    if generation is not None and generation.followers:
        return
    if (
        hold
        and generation is not None
        and generation.session
        and generation.shown
        and executor.reuse_hold_s > 0
    ):
        if request_id not in executor.held_aborts:
            executor.held_aborts[request_id] = asyncio.get_running_loop().call_later(
                executor.reuse_hold_s, _abort_held, executor, request_id
            )
        return
    await _stop(executor, request_id)


async def _stop(executor: RequestExecutor, request_id: str) -> None:
    """Abort ``request_id`` on the engine. Its generation takes no follower from now on:
    the abort lands a step (or an HTTP close) later and cuts it short, and a keystroke
    that typed through it in between would get a broken answer, not a suggestion."""
    generation = executor.reuse.of_owner(request_id)
    if generation is not None:
        generation.stopping = True
    await executor.engine.abort(request_id)


async def preempt(
    executor: RequestExecutor,
    request_id: str,
    *,
    taken: Callable[[RequestEnvelope], None] | None = None,
) -> bool:
    """Abort a request on the engine to run it again later: it reports nothing now
    (``run`` returns None), and ``taken`` is called once that is so (an abort that comes
    during its last step may find it ending as it would have). False when it cannot be:
    not generating (not started, or reporting its outcome), preempted already, or others
    follow its generation."""
    if not _preemptible(executor, request_id):
        return False
    executor.preempted.add(request_id)
    if taken is not None:
        executor.on_preempted[request_id] = taken
    await _stop(executor, request_id)
    return True


async def withdraw(executor: RequestExecutor, request_id: str) -> bool:
    """Stop a request whose partition went to another worker: that worker runs it and
    answers its client, so it reports nothing here (``run`` and ``follow`` return None),
    not even a cancel that comes meanwhile. A follower leaves its generation at once; a
    request others still follow runs on for them and stops when the last leaves. False
    when it is not running or following, or withdrawn or preempted already."""
    follower = executor.reuse.follower(request_id)
    if follower is not None:
        if follower.withdrawn:
            return False
        follower.withdrawn = follower.left = True
        follower.generation.wake()
        await executor.leave(request_id)
        return True
    if request_id not in executor.live or request_id in executor.preempted:
        return False
    executor.preempted.add(request_id)
    executor.withdrawn.add(request_id)
    generation = executor.reuse.of_owner(request_id)
    if generation is None or not generation.followers:
        await _stop(executor, request_id)
    return True


def _preemptible(executor: RequestExecutor, request_id: str) -> bool:
    if request_id not in executor.live or request_id in executor.preempted:
        return False
    generation = executor.reuse.of_owner(request_id)
    return generation is None or not generation.followers


async def release(executor: RequestExecutor, env: RequestEnvelope) -> None:
    """``env`` follows nothing: a held abort of its session's generation goes ahead."""
    if env.session is None:
        return
    for rid, timer in list(executor.held_aborts.items()):
        generation = executor.reuse.of_owner(rid)
        if generation is None or (generation.team, generation.session) != (
            env.team,
            env.session,
        ):
            continue
        timer.cancel()
        del executor.held_aborts[rid]
        if not generation.followers:
            await _stop(executor, rid)


def _abort_held(executor: RequestExecutor, request_id: str) -> None:
    executor.held_aborts.pop(request_id, None)
    generation = executor.reuse.of_owner(request_id)
    if generation is not None and not generation.followers and not generation.done:
        generation.stopping = True  # now, not when the task runs
        task = asyncio.get_running_loop().create_task(executor.engine.abort(request_id))
        executor.aborting.add(task)
        task.add_done_callback(executor.aborting.discard)


async def leave(executor: RequestExecutor, request_id: str) -> None:
    """A follower is done; the generation it followed stops if nobody wants it now: its
    own client left (or was superseded), or its partition went to another worker."""
    generation = executor.reuse.leave(request_id)
    if (
        generation is not None
        and not generation.done
        and not generation.followers
        and (
            generation.owner in executor.withdrawn
            or executor.shield.stale_reason(generation.owner) is not None
        )
    ):
        await _stop(executor, generation.owner)
