"""Admin API for shadow routes: start one, see each with its comparison, stop one.

``PUT /admin/shadow/{model}`` with ``{"target": ..., "share": 0.05}`` starts mirroring;
``GET /admin/shadow`` lists them, each with the streams app's shadow-against-primary figures;
``POST /admin/shadow/{model}/stop`` ends the mirroring (docs/shadow.md). ``{model}`` is the
rest of the path: a served model's name may have a ``/`` in it (``Qwen/Qwen2.5-Coder-7B``);
so a PUT to a path ending in ``/stop`` (a PUT in place of the POST) is refused, not taken as
a model of that name.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ingress.admin import authorise, refuse_misdirected_action
from ingress.responses import JSONResponse
from laneway.constants import RedisKeys
from laneway.openai_api import parse_body
from laneway.shadow import (
    ShadowState,
    get_comparison,
    list_shadows,
    start_shadow,
    stop_shadow,
)

__all__ = ["shadow_router"]

shadow_router = APIRouter(prefix="/admin/shadow")


class ShadowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1, max_length=200)
    share: float  # a fraction in (0, 1]: checked by ShadowState, whose error says so


async def _view(redis: aioredis.Redis, keys: RedisKeys, shadow: ShadowState) -> dict[str, object]:
    comparison = await get_comparison(redis, keys, shadow.model)
    compared = None
    if comparison is not None:
        compared = {**comparison.model_dump(mode="json"), **comparison.ratios()}
    return {**shadow.model_dump(mode="json", exclude={"salt"}), "comparison": compared}


@shadow_router.get("")
@shadow_router.get("/", include_in_schema=False)  # else the PUT's {model:path} answers 405
async def get_shadows(request: Request) -> Response:
    state = authorise(request)
    shadows = await list_shadows(state.redis, state.keys)
    return JSONResponse({"data": [await _view(state.redis, state.keys, s) for s in shadows]})


@shadow_router.put("/{model:path}")
async def put_shadow(model: str, request: Request) -> Response:
    state = authorise(request)
    refuse_misdirected_action(model, kind="shadow", action="stop")
    body = parse_body(ShadowBody, await request.body())
    started = await start_shadow(
        state.redis, state.keys, model, body.target, body.share, served=state.settings.models
    )
    return JSONResponse(await _view(state.redis, state.keys, started), status_code=201)


@shadow_router.post("/{model:path}/stop")
async def post_stop(model: str, request: Request) -> Response:
    state = authorise(request)
    stopped = await stop_shadow(state.redis, state.keys, model)
    return JSONResponse(await _view(state.redis, state.keys, stopped))
