"""Admin API: team records (size, complexity, tier, supersession policy) with their budget,
usage and factor; API keys (create, list, revoke).

Every route needs ``Authorization: Bearer <LANEWAY_ADMIN_KEY>``; without a key set, the API
is off (404). It is for operators inside the network: the public proxy does not pass
``/admin`` (see docs/security.md).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ingress.responses import JSONResponse
from ingress.state import IngressState
from laneway.apikeys import create_key, hash_key, key_id, list_keys, revoke_key
from laneway.errors import NotFound, Unauthorized
from laneway.openai_api import parse_body
from quota import Team, get_team, set_team

__all__ = ["admin_router", "is_admin"]

admin_router = APIRouter(prefix="/admin")


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=1)
    complexity: float = Field(1.0, gt=0, le=10)
    tier: str = Field("hi", pattern="^(hi|lo)$")
    supersede_grace_tokens: int = Field(0, ge=0)
    type_through: bool = True


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    team: str = Field(min_length=1, max_length=200)


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin key (never true while the admin API is off)."""
    state: IngressState = request.app.state.laneway
    expected = state.settings.admin_key.get_secret_value()
    given = request.headers.get("authorization", "")
    return bool(expected) and hmac.compare_digest(
        given.encode(errors="surrogatepass"), f"Bearer {expected}".encode()
    )


def authorise(request: Request) -> IngressState:
    state: IngressState = request.app.state.laneway
    if not state.settings.admin_key.get_secret_value():
        raise NotFound("the admin API is disabled (set LANEWAY_ADMIN_KEY)")
    if not is_admin(request):
        raise Unauthorized("admin key required: 'Authorization: Bearer <LANEWAY_ADMIN_KEY>'")
    return state


@admin_router.put("/teams/{team}")
async def put_team(team: str, request: Request) -> Response:
    state = authorise(request)
    body = parse_body(TeamBody, await request.body())
    record = Team(
        team,
        size=body.size,
        complexity=body.complexity,
        tier="lo" if body.tier == "lo" else "hi",
        supersede_grace_tokens=body.supersede_grace_tokens,
        type_through=body.type_through,
    )
    await set_team(state.redis, state.keys, record)
    return JSONResponse(await state.quota.enforcer.snapshot(record))


@admin_router.get("/teams/{team}")
async def get_team_budget(team: str, request: Request) -> Response:
    state = authorise(request)
    if not await state.redis.sismember(state.keys.teams(), team):
        raise NotFound(f"no team {team!r} (create it with PUT /admin/teams/{team})", param="team")
    record = await get_team(state.redis, state.keys, team)
    return JSONResponse(await state.quota.enforcer.snapshot(record))


@admin_router.post("/keys")
async def post_key(request: Request) -> Response:
    """A new key for a team: shown in this answer only (Redis keeps its hash)."""
    state = authorise(request)
    body = parse_body(KeyBody, await request.body())
    key = await create_key(state.redis, state.keys, body.team)
    created = {"id": key_id(hash_key(key)), "team": body.team, "key": key}
    return JSONResponse(created, status_code=201)


@admin_router.get("/keys")
async def get_keys(request: Request, team: str | None = None) -> Response:
    """The stored keys (of ``?team=``): ids, teams and creation times, never a key."""
    state = authorise(request)
    records = await list_keys(state.redis, state.keys, team)
    return JSONResponse({"object": "list", "data": [r.public() for r in records]})


@admin_router.delete("/keys/{key_or_id}")
async def delete_key(key_or_id: str, request: Request) -> Response:
    """Revoke a key, named by its id (or by the key itself): every replica refuses it."""
    state = authorise(request)
    record = await revoke_key(state.redis, state.producer, state.topics, state.keys, key_or_id)
    return JSONResponse({**record.public(), "revoked": True})
