"""Admin API: team records (size, complexity, tier, supersession policy) with their budget,
usage and factor; API keys (create, list, revoke).

Every route needs ``Authorization: Bearer <LANEWAY_ADMIN_KEY>``; without a key set, the API
is off (404). It is for operators inside the network: the public proxy does not pass
``/admin`` (see docs/security.md).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ingress.headers import authorization
from ingress.responses import JSONResponse
from ingress.state import IngressState
from laneway.apikeys import create_key, hash_key, key_id, list_keys, revoke_key
from laneway.errors import BadRequest, NotFound, Unauthorized
from laneway.openai_api import parse_body
from quota import Team, get_team, set_team
from quota.teams import MAX_GRACE_TOKENS, MAX_TEAM_SIZE

__all__ = [
    "KeyBody",
    "TeamBody",
    "admin_router",
    "create_team_key",
    "is_admin",
    "revoke_team_key",
    "save_team",
    "team_budget",
    "team_keys",
]

admin_router = APIRouter(prefix="/admin")


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=1, le=MAX_TEAM_SIZE)
    complexity: float = Field(1.0, gt=0, le=10)
    tier: str = Field("hi", pattern="^(hi|lo)$")
    supersede_grace_tokens: int = Field(0, ge=0, le=MAX_GRACE_TOKENS)
    type_through: bool = True


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    team: str = Field(min_length=1, max_length=200)


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin key (never true while the admin API is off);
    ``AdminKeyGuesses`` (429) while wrong ones have used up this replica's tries."""
    state: IngressState = request.app.state.laneway
    expected = state.settings.admin_key.get_secret_value()
    try:
        given = authorization(request.headers) or ""
    except BadRequest:
        return False  # two keys: the tenant routes say so; it is no admin's request
    return bool(expected) and state.admin_guesses.matches(given, f"Bearer {expected}")


def authorise(request: Request) -> IngressState:
    state: IngressState = request.app.state.laneway
    if not state.settings.admin_key.get_secret_value():
        raise NotFound("the admin API is disabled (set LANEWAY_ADMIN_KEY)")
    if not is_admin(request):
        raise Unauthorized("admin key required: 'Authorization: Bearer <LANEWAY_ADMIN_KEY>'")
    return state


def refuse_misdirected_action(model: str, *, kind: str, action: str) -> None:
    """A PUT whose model name ends in ``/<action>`` is that action sent with the wrong method
    (the routes take a model name with '/' in it): refused, naming the right request, rather
    than starting a ``kind`` for a model named ``x/<action>``."""
    if model.endswith(f"/{action}"):
        stem = model.removesuffix(f"/{action}")
        raise BadRequest(
            f"model {model!r}: PUT starts a {kind}; to {action} {stem!r}'s {kind}, "
            f"POST /admin/{kind}/{stem}/{action}",
            param="model",
        )


# The operations behind the routes; the web console (ingress/console/) calls the same ones.


async def save_team(state: IngressState, team: str, body: TeamBody) -> dict[str, object]:
    """Write a team's whole record; returns its budget snapshot."""
    record = Team(
        team,
        size=body.size,
        complexity=body.complexity,
        tier="lo" if body.tier == "lo" else "hi",
        supersede_grace_tokens=body.supersede_grace_tokens,
        type_through=body.type_through,
    )
    await set_team(state.redis, state.keys, record)
    return await state.quota.enforcer.snapshot(record)


async def team_budget(state: IngressState, team: str) -> dict[str, object]:
    """A known team's record with its budget, remaining, usage and factor; ``NotFound``."""
    if not await state.redis.sismember(state.keys.teams(), team):
        raise NotFound(
            f"no team {team!r} (create it with PUT /admin/teams/{quote(team, safe='')})",
            param="team",
        )
    record = await get_team(state.redis, state.keys, team)
    return await state.quota.enforcer.snapshot(record)


async def create_team_key(state: IngressState, team: str) -> dict[str, str]:
    """A new key for a team: the answer is the only place it is ever shown."""
    key = await create_key(state.redis, state.keys, team)
    return {"id": key_id(hash_key(key)), "team": team, "key": key}


async def team_keys(state: IngressState, team: str | None) -> list[dict[str, Any]]:
    """Ids, teams and creation times of the stored keys (of ``team``), never a key."""
    return [r.public() for r in await list_keys(state.redis, state.keys, team)]


async def revoke_team_key(state: IngressState, key_or_id: str) -> dict[str, Any]:
    """Revoke a key by its id (or the key itself): every replica refuses it, this one at once
    (the others once they read the revocation off Kafka)."""
    record = await revoke_key(state.redis, state.producer, state.topics, state.keys, key_or_id)
    state.revoked.add(record.hash)
    return {**record.public(), "revoked": True}


# ``{team:path}``: a new name has no '/' (``check_team_name`` says so, with a 400 rather than
# a 404 here); a team named with one before that rule is still reached.
@admin_router.put("/teams/{team:path}")
async def put_team(team: str, request: Request) -> Response:
    state = authorise(request)
    body = parse_body(TeamBody, await request.body())
    return JSONResponse(await save_team(state, team, body))


@admin_router.get("/teams/{team:path}")
async def get_team_budget(team: str, request: Request) -> Response:
    return JSONResponse(await team_budget(authorise(request), team))


@admin_router.post("/keys")
async def post_key(request: Request) -> Response:
    """A new key for a team: shown in this answer only (Redis keeps its hash)."""
    state = authorise(request)
    body = parse_body(KeyBody, await request.body())
    return JSONResponse(await create_team_key(state, body.team), status_code=201)


@admin_router.get("/keys")
async def get_keys(request: Request, team: str | None = None) -> Response:
    """The stored keys (of ``?team=``): ids, teams and creation times, never a key."""
    records = await team_keys(authorise(request), team)
    return JSONResponse({"object": "list", "data": records})


@admin_router.delete("/keys/{key_or_id}")
async def delete_key(key_or_id: str, request: Request) -> Response:
    """Revoke a key, named by its id (or by the key itself): every replica refuses it."""
    return JSONResponse(await revoke_team_key(authorise(request), key_or_id))
