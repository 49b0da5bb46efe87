"""The HTTP endpoints: OpenAI's completions, chat, models, plus cancel and health."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ingress import metrics
from ingress.admin import is_admin
from ingress.auth import Caller
from ingress.headers import authorization
from ingress.limits import OVER_LIMIT
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
from ingress.state import IngressState
from laneway.clock import RedisClock
from laneway.errors import (
    Aborted,
    BadRequest,
    BodyTooLarge,
    Cancelled,
    Dropped,
    EngineError,
    Expired,
    LanewayError,
    ModelNotFound,
    NotFound,
    PromptTooLarge,
    ServiceUnavailable,
    Superseded,
)
from laneway.metrics import team_label
from laneway.openai_api import ChatRequest, CompletionRequest, parse_body
from laneway.schema import ApiKind, Reply, RequestEnvelope
from quota import Admitted

__all__ = ["HOT_ROUTES", "router"]

log = logging.getLogger(__name__)
router = APIRouter()

# Request ids are ours ("cmpl-" and 24 hex digits; batch lines: laneway.batch.batch_request_id,
# at most 1,308 characters: a 200-character job id all escaped, a 500-character line id, a team).
_MAX_REQUEST_ID_CHARS = 2048
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

B = TypeVar("B", CompletionRequest, ChatRequest)


class _ClientGone(Exception):
    """The client closed its connection before the reply was complete."""


def _state(request: Request) -> IngressState:
    state: IngressState = request.app.state.laneway
    return state


# Drops the client may see (its own cancel, its newer keystroke, its deadline) by status.
_DROPS: dict[str, type[Dropped]] = {
    "expired": Expired,
    "cancelled": Cancelled,
    "superseded": Superseded,
    "aborted": Aborted,
}


def _reply_error(reply: Reply, *, kind: ApiKind) -> LanewayError:
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_reply(
    state: IngressState, channel: ReplyChannel, disconnect: asyncio.Future[None]
) -> Reply:
    if disconnect.done():
        raise _ClientGone
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
        raise _ClientGone
    raise Expired(f"no reply within {state.settings.reply_timeout_s}s (LANEWAY_REPLY_TIMEOUT_S)")


async def _serve(request: Request, model: type[B], cls: str) -> Response:
    state = _state(request)
    caller = await state.callers.resolve(authorization(request.headers))
    try:
        raw = await request.body()
    except ClientDisconnect:
        if request.scope.get(OVER_LIMIT):
            raise BodyTooLarge("request body over the limit (LANEWAY_MAX_BODY_BYTES)") from None
        metrics.CLIENT_GONE.labels(cls).inc()
        metrics.RESPONSES.labels(cls, "499").inc()
        return Response(status_code=499)
    body = parse_body(model, raw)
    env = state.admission.envelope(caller, body, request.headers, reply_to=state.reply_stream)
    clock = _Stages(state.clock)
    route, breaker_level = await _route(state, env, body.model)
    admitted = await state.quota.admit(caller.team, env.id, env.prompt_tokens + env.max_tokens)
    env = _admitted_envelope(env, route, admitted)
    clock.stage("admit")
    # x-request-id is what the OpenAI SDKs read as a response's request_id.
    headers = {"x-request-id": env.id, "x-laneway-request-id": env.id, **_budget_headers(admitted)}
    channel = state.replies.open(env.id, env.team)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    handed_over = False
    try:
        await _store(state, env, caller, admitted)
        clock.stage("enqueue")
        state.shadows.offer(env, breaker_level=breaker_level)
        first = await _next_reply(state, channel, disconnect)
        clock.stage("worker")
        if not body.stream:
            if first.done:
                return _finish_json(env, first, headers=headers, clock=clock)
            return await _collect(
                state, env, channel, disconnect, first, headers=headers, clock=clock
            )
        if first.done and first.status != "ok":
            raise _reply_error(first, kind=env.kind)
        handed_over = True
        return StreamingResponse(
            _stream(state, env, channel, disconnect, first, include_usage=body.include_usage),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "server-timing": clock.header(env)},
        )
    except _ClientGone:
        state.client_gone(env)
        return Response(status_code=499)
    except LanewayError as exc:
        if isinstance(exc, Expired):
            state.cancels.add(env)
        exc.request_id = env.id  # the error response names the request, as a success does
        raise
    finally:
        if not handed_over:
            disconnect.cancel()
            state.replies.close(env.id)


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


class _Stages:
    """Where a request's time went inside the ingress, for the Server-Timing header."""

    def __init__(self, wall: RedisClock) -> None:
        self.wall = wall  # the clock accepted_ts was stamped on
        self._last = time.perf_counter()
        self.spent: dict[str, float] = {}

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.spent[name] = self.spent.get(name, 0.0) + (now - self._last) * 1000
        self._last = now

    def header(self, env: RequestEnvelope) -> str:
        """``laneway`` is acceptance to now; its parts are admit (breaker and quota), enqueue
        (until Kafka stored the envelope) and worker (until the reply came back)."""
        total = (self.wall.now() - env.accepted_ts) * 1000
        parts = [f"laneway;dur={total:.2f}"]
        parts += [f"{name};dur={ms:.2f}" for name, ms in self.spent.items()]
        return ", ".join(parts)


def _budget_headers(admitted: Admitted | None) -> dict[str, str]:
    if admitted is None:
        return {}
    return {
        "x-ratelimit-limit-tokens": str(admitted.capacity),
        "x-ratelimit-remaining-tokens": str(max(0, admitted.remaining)),
        "x-ratelimit-reset-tokens": f"{admitted.reset_s:.0f}s",
    }


def _observe(env: RequestEnvelope, code: int, now: float) -> None:
    metrics.RESPONSES.labels(env.cls, str(code)).inc()
    latency = max(0.0, now - env.accepted_ts)
    metrics.LATENCY.labels(team_label(env.team), env.cls, env.model).observe(latency)


def _finish_json(
    env: RequestEnvelope,
    reply: Reply,
    text: str | None = None,
    *,
    headers: dict[str, str],
    clock: _Stages,
) -> Response:
    if reply.status != "ok":
        raise _reply_error(reply, kind=env.kind)
    _observe(env, 200, clock.wall.now())
    body = final_body(env, reply.text if text is None else text, reply)
    extra = {"x-laneway-route": reply.route or env.route, "server-timing": clock.header(env)}
    return JSONResponse(body, headers={**headers, **extra})


async def _collect(
    state: IngressState,
    env: RequestEnvelope,
    channel: ReplyChannel,
    disconnect: asyncio.Future[None],
    first: Reply,
    *,
    headers: dict[str, str],
    clock: _Stages,
) -> Response:
    parts = [first.text]
    reply = first
    while not reply.done:
        reply = await _next_reply(state, channel, disconnect)
        parts.append(reply.text)
    clock.stage("worker")
    return _finish_json(env, reply, "".join(parts), headers=headers, clock=clock)


async def _stream(
    state: IngressState,
    env: RequestEnvelope,
    channel: ReplyChannel,
    disconnect: asyncio.Future[None],
    first: Reply,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    finished = False
    reply = first
    try:
        role = env.kind == "chat"
        while True:
            if reply.text or role:
                yield stream_chunk(env, text=reply.text, role=role)
                role = False
            if reply.done:
                _observe(env, 200 if reply.status == "ok" else 500, state.clock.now())
                if reply.status == "ok":
                    yield stream_chunk(env, finish_reason=reply.finish_reason)
                    if include_usage:
                        yield stream_chunk(env, usage=usage_body(reply))
                else:
                    err = _reply_error(reply, kind=env.kind)
                    kind = (
                        "invalid_request_error" if isinstance(err, BadRequest) else "server_error"
                    )
                    code = err.code if isinstance(err, PromptTooLarge) else reply.status
                    yield sse(error_body(str(err), type_=kind, code=code, param=err.param))
                yield DONE
                finished = True
                return
            reply = await _next_reply(state, channel, disconnect)
    except _ClientGone:
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


@router.delete("/v1/requests/{request_id}")
async def cancel_request(request_id: str, request: Request) -> Response:
    """Cancel a request of the caller's team; another team's request is 'not found'."""
    state = _state(request)
    caller = await state.callers.resolve(authorization(request.headers))
    if len(request_id) > _MAX_REQUEST_ID_CHARS or _CONTROL.search(request_id):
        raise BadRequest(
            f"request id of {len(request_id)} characters: ids have up to "
            f"{_MAX_REQUEST_ID_CHARS} printable ones (see x-laneway-request-id)",
            param="request_id",
        )
    # Whether this replica holds it, as of the call (before the awaits below).
    owner = state.replies.owner(request_id)
    if owner is not None and owner != caller.team.name:
        raise NotFound(
            f"no request {request_id!r} of team {caller.team.name!r}", param="request_id"
        )
    await state.cancel_limit.check(caller.team.name)  # 429 beyond LANEWAY_CANCELS_PER_S
    await state.send_cancel(request_id, caller.team.name)
    # Held here: known to be live. Held by another replica: the worker checks the team.
    body = {
        "id": request_id,
        "object": "request.cancel",
        "status": "cancelled" if owner else "requested",
    }
    return JSONResponse(body, status_code=200 if owner else 202)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    await state.callers.resolve(authorization(request.headers))
    created = int(state.started_at)
    data = [_model(m, created) for m in state.settings.models]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    """One served model (the SDK's ``models.retrieve``); 404 in OpenAI's shape otherwise."""
    state = _state(request)
    await state.callers.resolve(authorization(request.headers))
    if model_id not in state.settings.models:
        raise ModelNotFound(
            f"model {model_id[:200]!r} is not served here; available: "
            f"{sorted(state.settings.models)} (LANEWAY_MODELS)",
            param="model",
        )
    return JSONResponse(_model(model_id, int(state.started_at)))


def _model(model_id: str, created: int) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "laneway"}


@router.get("/healthz")
async def healthz() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready or not, for anyone (a load balancer); with the admin key, each check too."""
    checks = await _state(request).readiness()
    ready = all(c["ok"] or c.get("degraded") for c in checks.values())
    body: dict[str, Any] = {"ready": ready}
    if is_admin(request):
        body["checks"] = checks
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    metrics.OPEN_REQUESTS.set(_state(request).replies.open_channels)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
