"""Admin API for canary routes: start one, see where each stands, abort one.

``PUT /admin/canary/{model}`` with ``{"target": ..., "steps": [1, 5, 10, 100]}`` starts it;
``GET /admin/canary`` lists them; ``POST /admin/canary/{model}/abort`` sends every request
back to the stable route at once. The streams app moves the steps (docs/canary.md).
``{model}`` is the rest of the path: a served model's name may have a ``/`` in it
(``Qwen/Qwen2.5-Coder-7B``), written as it is or as ``%2F``; so a PUT to a path ending in
``/abort`` (a PUT in place of the POST) is refused, not taken as a model of that name.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ingress.admin import authorise, refuse_misdirected_action
from ingress.responses import JSONResponse
from laneway.canary import DEFAULT_STEPS, CanaryState, abort_canary, list_canaries, start_canary
from laneway.openai_api import parse_body

__all__ = ["canary_router"]

canary_router = APIRouter(prefix="/admin/canary")


class CanaryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1, max_length=200)
    steps: tuple[float, ...] = DEFAULT_STEPS


def _view(state: CanaryState) -> dict[str, object]:
    # Not the salt: with it a team could compute which of its sessions the canary takes.
    return {**state.model_dump(mode="json", exclude={"salt"}), "weight": state.weight}


@canary_router.get("")
@canary_router.get("/", include_in_schema=False)  # else the PUT's {model:path} answers 405
async def get_canaries(request: Request) -> Response:
    state = authorise(request)
    canaries = await list_canaries(state.redis, state.keys)
    return JSONResponse({"data": [_view(c) for c in canaries]})


@canary_router.put("/{model:path}")
async def put_canary(model: str, request: Request) -> Response:
    state = authorise(request)
    refuse_misdirected_action(model, kind="canary", action="abort")
    body = parse_body(CanaryBody, await request.body())
    started = await start_canary(
        state.redis, state.keys, model, body.target, body.steps, served=state.settings.models
    )
    return JSONResponse(_view(started), status_code=201)


@canary_router.post("/{model:path}/abort")
async def post_abort(model: str, request: Request) -> Response:
    state = authorise(request)
    return JSONResponse(_view(await abort_canary(state.redis, state.keys, model)))
