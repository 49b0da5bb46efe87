"""Admin API: set a team's record (size, complexity, tier, supersession policy); read its
budget, usage and factor."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ingress.responses import JSONResponse
from ingress.state import IngressState
from laneway.errors import NotFound, Unauthorized
from laneway.openai_api import parse_body
from quota import Team, get_team, set_team

__all__ = ["admin_router"]

admin_router = APIRouter(prefix="/admin")


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=1)
    complexity: float = Field(1.0, gt=0, le=10)
    tier: str = Field("hi", pattern="^(hi|lo)$")
    supersede_grace_tokens: int = Field(0, ge=0)
    type_through: bool = True


def _authorise(request: Request) -> IngressState:
    state: IngressState = request.app.state.laneway
    expected = state.settings.admin_key.get_secret_value()
    if not expected:
        raise NotFound("the admin API is disabled (set LANEWAY_ADMIN_KEY)")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise Unauthorized("admin key required: 'Authorization: Bearer <LANEWAY_ADMIN_KEY>'")
    return state


@admin_router.put("/teams/{team}")
async def put_team(team: str, request: Request) -> Response:
    state = _authorise(request)
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
    state = _authorise(request)
    if not await state.redis.sismember(state.keys.teams(), team):
        raise NotFound(f"no team {team!r} (create it with PUT /admin/teams/{team})", param="team")
    record = await get_team(state.redis, state.keys, team)
    return JSONResponse(await state.quota.enforcer.snapshot(record))
