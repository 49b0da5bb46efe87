"""OpenAI's completions and chat completions, the two paths every request takes: a body
becomes an envelope, routed and admitted, stored on Kafka, and its replies the response."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ingress import metrics
from ingress.auth import Caller
from ingress.headers import authorization
from ingress.limits import OVER_LIMIT
from ingress.reply_delivery import (
    ClientGone,
    collect_json,
    finish_json,
    next_reply,
    reply_error,
    sse_events,
)
from ingress.server_timing import ServerTiming
from ingress.state import IngressState
from laneway.errors import (
    BodyTooLarge,
    BodyTooSlow,
    Expired,
    LanewayError,
    ServiceUnavailable,
)
from laneway.openai_api import ChatRequest, CompletionRequest, parse_body
from laneway.schema import RequestEnvelope
from quota import Admitted

__all__ = ["HOT_ROUTES"]

log = logging.getLogger(__name__)

B = TypeVar("B", CompletionRequest, ChatRequest)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _body(request: Request, timeout_s: float, cls: str) -> bytes | None:
    """The request's body, within ``timeout_s``; None when its client left before its end."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.body()
    except TimeoutError:
        raise BodyTooSlow(
            f"request body not complete within {timeout_s:g} s (LANEWAY_READ_TIMEOUT_S)"
        ) from None
    except ClientDisconnect:
        if request.scope.get(OVER_LIMIT):
            raise BodyTooLarge("request body over the limit (LANEWAY_MAX_BODY_BYTES)") from None
        metrics.CLIENT_GONE.labels(cls).inc()
        metrics.RESPONSES.labels(cls, "499").inc()
        return None


async def _serve(request: Request, model: type[B], cls: str) -> Response:
    state: IngressState = request.app.state.laneway
    try:
        caller = await state.callers.resolve(authorization(request.headers))
        raw = await _body(request, state.settings.read_timeout_s, cls)
    except asyncio.CancelledError:
        raise _stopping(None, "before it was read") from None
    if raw is None:
        return Response(status_code=499)
    body = parse_body(model, raw)
    env = state.admission.envelope(
        caller, body, request.headers, reply_to=state.reply_stream, ingress=state.incarnation
    )
    clock = ServerTiming(state.clock)
    env, breaker_level, admitted = await _admit(state, caller, env, body.model)
    clock.stage("admit")
    # x-request-id is what the OpenAI SDKs read as a response's request_id.
    headers = {"x-request-id": env.id, "x-laneway-request-id": env.id, **_budget_headers(admitted)}
    channel = state.replies.open(env.id, env.team)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    handed_over = stored = False
    try:
        await _store(state, env, caller, admitted)
        stored = True
        clock.stage("enqueue")
        state.shadows.offer(env, breaker_level=breaker_level)
        first = await next_reply(state, channel, disconnect)
        clock.stage("worker")
        if not body.stream:
            if first.done:
                return finish_json(env, first, headers=headers, clock=clock)
            return await collect_json(
                state, env, channel, disconnect, first, headers=headers, clock=clock
            )
        if first.done and first.status != "ok":
            raise reply_error(first, kind=env.kind)
        handed_over = True
        return StreamingResponse(
            sse_events(state, env, channel, disconnect, first, include_usage=body.include_usage),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "server-timing": clock.header(env)},
        )
    except ClientGone:
        state.client_gone(env)
        return Response(status_code=499)
    except asyncio.CancelledError:
        # The server stops past its grace (LANEWAY_SHUTDOWN_GRACE_S) before the answer (it
        # cancels nothing else): its worker is told to stop, as for a client that left, or
        # the client's retry elsewhere would run and be charged beside it. The tombstone
        # goes first, while the ingress's Kafka and Redis clients still run.
        state.cancels.add(env)
        if not stored:
            # Cut short in its produce, it may be stored all the same: its budget goes back
            # as for a produce that failed (the worker's settle of a stored copy, dropped on
            # its tombstone, is then a no-op).
            await state.quota.release(caller.team, env.id, admitted, accepted_ts=env.accepted_ts)
        raise _stopping(env, "unanswered; its worker is told to stop it") from None
    except LanewayError as exc:
        if isinstance(exc, Expired):
            state.cancels.add(env)
        exc.request_id = env.id  # the error response names the request, as a success does
        raise
    finally:
        if not handed_over:
            disconnect.cancel()
            state.replies.close(env.id)


def _stopping(env: RequestEnvelope | None, how: str) -> ServiceUnavailable:
    """The 503 of a request that a stopping ingress cancels past its grace
    (LANEWAY_SHUTDOWN_GRACE_S), wherever it was: the client (the OpenAI SDK does) sends it
    again to another replica, rather than reading a bare 500 or a dropped connection."""
    request_id = None if env is None else env.id
    log.warning(
        "stopping: request %s dropped %s",
        request_id or "(not read yet)",
        how,
        extra={} if env is None else {"request_id": env.id, "team": env.team, "cls": env.cls},
    )
    dropped = ServiceUnavailable("this ingress is stopping: send the request again")
    dropped.request_id = request_id
    return dropped


async def _admit(
    state: IngressState, caller: Caller, env: RequestEnvelope, model: str
) -> tuple[RequestEnvelope, int, Admitted | None]:
    """``env`` routed and admitted by its quota, with the breaker's level and the admission.
    Cut short by a stopping ingress, nothing of it was stored and whatever its admission may
    have reserved goes back (``QuotaGate.give_back_cut_short``). A refusal (an unknown model,
    a breaker, the quota's 429) names the request's id, as its answer would."""
    try:
        route, breaker_level = await _route(state, env, model)
        admitted = await state.quota.admit(caller.team, env.id, env.prompt_tokens + env.max_tokens)
    except asyncio.CancelledError:
        # Cut short while routed (nothing reserved: the give-back changes nothing) or while
        # its quota was admitted (the script may have run).
        await state.quota.give_back_cut_short(caller.team, env.id, accepted_ts=env.accepted_ts)
        raise _stopping(env, "before it was admitted; any reservation goes back") from None
    except LanewayError as exc:
        exc.request_id = env.id
        raise
    return _admitted_envelope(env, route, admitted), breaker_level, admitted


def _admitted_envelope(
    env: RequestEnvelope, route: str, admitted: Admitted | None
) -> RequestEnvelope:
    """``env`` with its route, and how its quota was admitted (a lease, or the local limiter
    while Redis did not answer): its worker settles it by these."""
    update: dict[str, Any] = {}
    if route != env.route:
        update["route"] = route
    if admitted is not None and admitted.leased:
        update["quota_leased"] = admitted.leased
    if admitted is not None and admitted.local:
        update["quota_local"] = admitted.local
    return env.model_copy(update=update) if update else env


async def _route(state: IngressState, env: RequestEnvelope, model: str) -> tuple[str, int]:
    """The breaker's route for ``model`` (level 3: 503), or its canary's for this session;
    and the breaker's level."""
    decision = await state.breaker.route_for(env.team, model)
    if decision.level > 0:  # a degraded model serves its fallbacks, not an experiment
        return decision.route, decision.level
    canary = await state.canaries.route(model, env.team, env.session or env.id)
    return canary or decision.route, decision.level


async def _store(
    state: IngressState, env: RequestEnvelope, caller: Caller, admitted: Admitted | None
) -> None:
    """Produce ``env``; when Kafka refuses it, its budget goes back, it is tombstoned (it
    may be stored all the same) and the client gets a 503 (the broker's words go to the
    log, not to the client)."""
    try:
        await state.produce(env)
    except MessageSizeTooLargeError as exc:
        # No retry can store it: the client's to shorten, not to wait for (a 503 would make
        # the OpenAI SDK try it again and again).
        await state.quota.release(caller.team, env.id, admitted, accepted_ts=env.accepted_ts)
        raise BodyTooLarge(
            f"the request is {len(env.to_json()):,} bytes as queued, more than the request "
            "queue takes in one message: shorten the prompt, the messages or the stop strings"
        ) from exc
    except KafkaError as exc:
        await state.quota.release(caller.team, env.id, admitted, accepted_ts=env.accepted_ts)
        # A produce that timed out may have been stored all the same: its tombstone keeps a
        # worker from running it beside the copy the client now sends again (its own id).
        state.cancels.add(env)
        log.warning(
            "request %s not stored, Kafka refused it: %r",
            env.id,
            exc,
            extra={"request_id": env.id, "team": env.team, "cls": env.cls},
        )
        raise ServiceUnavailable(
            "the request queue did not accept the request; retry shortly"
        ) from exc


def _budget_headers(admitted: Admitted | None) -> dict[str, str]:
    if admitted is None:
        return {}
    return {
        "x-ratelimit-limit-tokens": str(admitted.capacity),
        "x-ratelimit-remaining-tokens": str(max(0, admitted.remaining)),
        "x-ratelimit-reset-tokens": f"{admitted.reset_s:.0f}s",
    }


async def completions(request: Request) -> Response:
    return await _counted(request, CompletionRequest, "completion")


async def chat_completions(request: Request) -> Response:
    return await _counted(request, ChatRequest, "chat")


async def _counted(request: Request, model: type[B], cls: str) -> Response:
    """``_serve``; an error it answers with counts among the responses by its status too."""
    try:
        return await _serve(request, model, cls)
    except LanewayError as exc:
        metrics.RESPONSES.labels(cls, str(exc.status_code)).inc()
        raise


# The two paths every request takes are plain Starlette routes: FastAPI's per-request
# dependency and signature machinery costs about 70 µs a request here and does nothing for a
# handler that parses its own body (`python -m bench.hops` measures both).
HOT_ROUTES = (
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
)
