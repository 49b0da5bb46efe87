"""The HTTP endpoints besides the two hot paths (``ingress.completions``): OpenAI's models, a
request's cancel, health and metrics."""

from __future__ import annotations

import contextlib
import re
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from ingress import metrics
from ingress.admin import is_admin
from ingress.headers import authorization
from ingress.responses import JSONResponse
from ingress.state import IngressState
from laneway.errors import AdminKeyGuesses, BadRequest, ModelNotFound, NotFound

__all__ = ["router"]

router = APIRouter()

# Request ids are ours ("cmpl-" and 24 hex digits; batch lines: laneway.batch.batch_request_id,
# at most 1,308 characters: a 200-character job id all escaped, a 500-character line id, a team).
_MAX_REQUEST_ID_CHARS = 2048
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _state(request: Request) -> IngressState:
    state: IngressState = request.app.state.laneway
    return state


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
    with contextlib.suppress(AdminKeyGuesses):  # the answer a load balancer gets, then
        if is_admin(request):
            body["checks"] = checks
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    metrics.OPEN_REQUESTS.set(_state(request).replies.open_channels)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
