"""A request's replies to its client: one JSON body, or an SSE stream, until the last reply,
the reply timeout, or the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response

from ingress import metrics
from ingress.replies import ReplyChannel
from ingress.responses import (
    DONE,
    JSONResponse,
    error_body,
    final_body,
    sse,
    stream_chunk,
    usage_body,
)
from ingress.server_timing import ServerTiming
from ingress.state import IngressState
from laneway.errors import (
    Aborted,
    BadRequest,
    Cancelled,
    Dropped,
    EngineError,
    Expired,
    LanewayError,
    PromptTooLarge,
    Superseded,
)
from laneway.metrics import team_label
from laneway.schema import ApiKind, Reply, RequestEnvelope
from laneway.tool_frames import CallReader

__all__ = ["ClientGone", "collect_json", "finish_json", "next_reply", "reply_error", "sse_events"]


class ClientGone(Exception):
    """The client closed its connection before the reply was complete."""


# Drops the client may see (its own cancel, its newer keystroke, its deadline) by status.
_DROPS: dict[str, type[Dropped]] = {
    "expired": Expired,
    "cancelled": Cancelled,
    "superseded": Superseded,
    "aborted": Aborted,
}


def reply_error(reply: Reply, *, kind: ApiKind) -> LanewayError:
    """What a reply that is not ``ok`` tells the client, as a laneway error."""
    message = reply.error or reply.status or "request failed"
    if reply.status in ("rejected", "unsupported"):
        # The engine refused the request itself, or has not what it asks for (a parameter
        # such as suffix): the worker passes on the engine's reason, meant for the client,
        # and the field it names. Over the model's context, in words a known server uses, it
        # is OpenAI's context_length_exceeded, as the ingress's own limit is.
        prompt = "messages" if kind == "chat" else "prompt"
        too_large = PromptTooLarge.from_engine(message, param=prompt)
        return too_large or BadRequest(message, param=reply.param)
    dropped = _DROPS.get(reply.status or "")
    if dropped is not None:
        return dropped(message)
    # What failed inside the engine (an upstream's address, a stack) is the operator's
    # business: the usage event and the worker's log have it.
    return EngineError(f"the engine failed on request {reply.id}; retry it")


async def next_reply(
    state: IngressState, channel: ReplyChannel, disconnect: asyncio.Future[None]
) -> Reply:
    """The request's next reply; ``ClientGone`` once ``disconnect`` is done, ``Expired``
    after ``LANEWAY_REPLY_TIMEOUT_S`` without one."""
    if disconnect.done():
        raise ClientGone
    reply = channel.take()
    if reply is not None:
        return reply  # chunks that came together: no waiting
    arrival = channel.arrival()
    try:
        # Cancelled too when the client's disconnect stops the streaming response.
        await asyncio.wait(
            {arrival, disconnect},
            timeout=state.settings.reply_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        arrival.cancel()
    reply = channel.take()
    if reply is not None:
        return reply
    if disconnect.done():
        raise ClientGone
    raise Expired(f"no reply within {state.settings.reply_timeout_s}s (LANEWAY_REPLY_TIMEOUT_S)")


def _observe(env: RequestEnvelope, code: int, now: float) -> None:
    metrics.RESPONSES.labels(env.cls, str(code)).inc()
    latency = max(0.0, now - env.accepted_ts)
    metrics.LATENCY.labels(team_label(env.team), env.cls, env.model).observe(latency)


def finish_json(
    env: RequestEnvelope,
    reply: Reply,
    text: str | None = None,
    *,
    headers: dict[str, str],
    clock: ServerTiming,
) -> Response:
    """The response to a request whose last reply is ``reply``; ``text``, when given, is the
    whole text (its replies' parts together)."""
    if reply.status != "ok":
        raise reply_error(reply, kind=env.kind)
    _observe(env, 200, clock.wall.now())
    body = final_body(env, reply.text if text is None else text, reply)
    extra = {"x-laneway-route": reply.route or env.route, "server-timing": clock.header(env)}
    return JSONResponse(body, headers={**headers, **extra})


async def collect_json(
    state: IngressState,
    env: RequestEnvelope,
    channel: ReplyChannel,
    disconnect: asyncio.Future[None],
    first: Reply,
    *,
    headers: dict[str, str],
    clock: ServerTiming,
) -> Response:
    """The replies from ``first`` to the last, as one JSON response."""
    parts = [first.text]
    ids = dict(first.call_ids or {})
    reply = first
    while not reply.done:
        reply = await next_reply(state, channel, disconnect)
        parts.append(reply.text)
        for index, call_id in (reply.call_ids or {}).items():
            ids.setdefault(index, call_id)  # the first id of a call is the one that stands
    clock.stage("worker")
    if ids:
        reply = reply.model_copy(update={"call_ids": ids})
    return finish_json(env, reply, "".join(parts), headers=headers, clock=clock)


async def sse_events(
    state: IngressState,
    env: RequestEnvelope,
    channel: ReplyChannel,
    disconnect: asyncio.Future[None],
    first: Reply,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The replies from ``first`` on as SSE chunks, to ``[DONE]``; the request's channel is
    closed at the end, however it ends."""
    finished = False
    reply = first
    # A chat with tools frames its calls in its text (``laneway.tool_frames``).
    calls = CallReader(env.id) if env.tools else None
    try:
        role = env.kind == "chat"
        while True:
            text, deltas = (
                (reply.text, None) if calls is None else calls.read(reply.text, reply.call_ids)
            )
            if text or role:
                yield stream_chunk(env, text=text, role=role)
                role = False
            if deltas:
                yield stream_chunk(env, tool_calls=deltas)
            if reply.done:
                if reply.status == "ok":
                    _observe(env, 200, state.clock.now())
                    yield stream_chunk(env, finish_reason=reply.finish_reason)
                    if include_usage:
                        yield stream_chunk(env, usage=usage_body(reply))
                else:
                    # The error a request that was not streamed gets, in the same words
                    # (type, code, param), and counted under its status.
                    err = reply_error(reply, kind=env.kind)
                    _observe(env, err.status_code, state.clock.now())
                    yield sse(
                        error_body(str(err), type_=err.error_type, code=err.code, param=err.param)
                    )
                yield DONE
                finished = True
                return
            reply = await next_reply(state, channel, disconnect)
    except ClientGone:
        return
    except Expired as exc:
        # The client is still here and told: not a 499. Its worker is told to stop.
        finished = True
        _observe(env, 504, state.clock.now())
        state.cancels.add(env)
        yield sse(error_body(str(exc), type_="timeout", code="deadline_exceeded"))
        yield DONE
    finally:
        disconnect.cancel()
        state.replies.close(env.id)
        if not finished:
            state.client_gone(env)
