"""Shadow routes: a share of a model's requests is copied to another route, whose answers go
nowhere, so a new version meets real traffic before any client depends on it.

One shadow per model, kept in Redis as JSON at ``<prefix>:shadow:<model>`` (the set
``<prefix>:shadows`` lists the models that have one). The ingress mirrors a request when its
sticky key (the team's session, else the request id) falls in the first ``share`` of the
buckets: whole sessions are mirrored, keystroke after keystroke, so the shadow sees what the
primary sees (supersession, prefix reuse). The mirror is the same envelope with the id
``<id>-shadow``, the shadow's route, the ``lo`` band, no reply stream and ``shadow: true``:
workers run it like any other and discard its text, and its usage event is marked ``shadow``
(not billed). The streams app compares its latency and errors with the primary's
(``streams/shadow.py``); people start and stop it (``laneway shadow``, ``/admin/shadow``).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Collection
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from laneway.canary import bucket
from laneway.constants import RedisKeys
from laneway.errors import BadRequest, Conflict, NotFound
from laneway.requests import check_served
from laneway.schema import RequestEnvelope

__all__ = [
    "SHADOW_ID_SUFFIX",
    "ShadowComparison",
    "ShadowState",
    "ShadowStats",
    "get_comparison",
    "get_shadow",
    "list_shadows",
    "mirrored",
    "parse_share",
    "shadow_envelope",
    "shadow_id",
    "start_shadow",
    "stop_shadow",
]

ShadowStatus = Literal["running", "stopped"]
SHADOW_ID_SUFFIX = "-shadow"


def parse_share(text: str) -> float:
    """``"0.05"`` → 0.05: the share of requests mirrored, a fraction in (0, 1]."""
    try:
        share = float(text)
    except ValueError:
        raise BadRequest(
            f"share must be a fraction like 0.05 (5 % of requests), not {text!r}", param="share"
        ) from None
    return _checked_share(share)


def _checked_share(share: float) -> float:
    if not (math.isfinite(share) and 0 < share <= 1):
        hint = f" (for {share:g} % write {share / 100:g})" if 1 < share <= 100 else ""
        raise BadRequest(
            f"share must be a fraction in (0, 1], e.g. 0.05 for 5 % of requests; got "
            f"{share:g}{hint}",
            param="share",
        )
    return share


class ShadowState(BaseModel):
    """A model's shadow: where its mirrors go and what share of the sticky keys is mirrored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, max_length=200)
    target: str = Field(min_length=1, max_length=200)
    share: float
    status: ShadowStatus = "running"
    started: float = Field(default_factory=time.time)
    since: float = Field(default_factory=time.time)  # when the status began
    reason: str = ""
    # Drawn when the shadow starts, never shown: which sessions are mirrored is not a hash a
    # tenant can compute, so no team can name its sessions to have all its traffic mirrored
    # (unbilled engine work, and the mirror slots other teams' sessions would have had).
    salt: str = Field("", repr=False)

    @model_validator(mode="after")
    def _consistent(self) -> ShadowState:
        _checked_share(self.share)
        if self.target == self.model:
            raise BadRequest("a shadow's target must differ from the model", param="target")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


def mirrored(state: ShadowState | None, team: str, sticky: str) -> bool:
    """Whether this sticky key's requests are mirrored: the same answer for a whole session."""
    if state is None or state.status != "running":
        return False
    return bucket(team, sticky, state.salt) < state.share * 100


def shadow_id(request_id: str) -> str | None:
    """The id of ``request_id``'s mirror (None for a mirror's own id): a primary's tombstone
    ends its mirror too, wherever the mirror is, queued or running."""
    return None if request_id.endswith(SHADOW_ID_SUFFIX) else request_id + SHADOW_ID_SUFFIX


def shadow_envelope(env: RequestEnvelope, target: str) -> RequestEnvelope:
    """The mirror of ``env`` on ``target``.

    It keeps the session and seq, so the primary's next keystroke makes it stale as it
    makes the primary stale; the ``lo`` band and the primary's deadline make it the first
    work a busy worker leaves (it waits behind ``hi`` and expires rather than queues). No
    reply stream, no stream, no type-through: no text of it can reach a client. No quota:
    nothing was reserved for it and nothing is settled.
    """
    return env.model_copy(
        update={
            "id": env.id + SHADOW_ID_SUFFIX,
            "route": target,
            "band": "lo",
            "reply_to": None,
            "stream": False,
            "reuse": False,
            "quota_leased": 0,
            "quota_local": 0,
            "shadow": True,
        }
    )


class ShadowStats(BaseModel):
    """One side's served requests over the window: errors, and latency of the successful
    ones from the engine's start to the end (the shadow's wait in the ``lo`` band is left
    out: it says how laneway ranks mirrors, not how fast the route serves)."""

    requests: int
    errors: int
    error_rate: float
    p50_ms: float | None = None
    p99_ms: float | None = None


class ShadowComparison(BaseModel):
    """The streams app's figures for a model's shadow, over its last ``window_s``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    target: str
    window_s: float
    primary: ShadowStats | None = None
    shadow: ShadowStats | None = None
    ts: float = Field(default_factory=time.time)

    def ratios(self) -> dict[str, float | None]:
        """Shadow over primary: P50, P99 (None without both), error rate difference."""
        p, s = self.primary, self.shadow

        def over(a: float | None, b: float | None) -> float | None:
            return round(a / b, 3) if a is not None and b else None

        return {
            "p50_ratio": over(s.p50_ms, p.p50_ms) if s and p else None,
            "p99_ratio": over(s.p99_ms, p.p99_ms) if s and p else None,
            "error_rate_diff": round(s.error_rate - p.error_rate, 6) if s and p else None,
        }

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


async def get_shadow(redis: aioredis.Redis, keys: RedisKeys, model: str) -> ShadowState | None:
    raw = await redis.get(keys.shadow(model))
    return ShadowState.model_validate_json(raw) if raw else None


async def list_shadows(redis: aioredis.Redis, keys: RedisKeys) -> list[ShadowState]:
    members = await redis.smembers(keys.shadows())
    models = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
    if not models:
        return []
    raws = await redis.mget([keys.shadow(m) for m in models])
    return [ShadowState.model_validate_json(raw) for raw in raws if raw]


async def get_comparison(
    redis: aioredis.Redis, keys: RedisKeys, model: str
) -> ShadowComparison | None:
    raw = await redis.get(keys.shadow_comparison(model))
    return ShadowComparison.model_validate_json(raw) if raw else None


async def _put(redis: aioredis.Redis, keys: RedisKeys, state: ShadowState) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.shadow(state.model), state.to_json())
        pipe.sadd(keys.shadows(), state.model)
        await pipe.execute()


async def start_shadow(
    redis: aioredis.Redis,
    keys: RedisKeys,
    model: str,
    target: str,
    share: float,
    *,
    served: Collection[str] | None = None,
) -> ShadowState:
    """Mirror ``share`` of ``model``'s requests to ``target``; one running shadow a model.
    ``served``: the models clients may ask for (a shadow of another would show "running"
    for ever, mirroring nothing); None: not checked."""
    try:
        state = ShadowState(model=model, target=target, share=share, salt=secrets.token_hex(16))
    except ValidationError as exc:  # a name too long or empty: the caller's input
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "model"
        raise BadRequest(f"{field}: {error['msg']}", param=field) from None
    if served is not None:
        check_served(model, served)
    current = await get_shadow(redis, keys, model)
    if current is not None and current.status == "running":
        raise Conflict(
            f"model {model!r} already has a shadow running (→ {current.target}, "
            f"{current.share:.1%} of requests); stop it first",
            param="model",
        )
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.shadow_comparison(model))  # the last shadow's figures are not this one's
        pipe.set(keys.shadow(model), state.to_json())
        pipe.sadd(keys.shadows(), model)
        await pipe.execute()
    return state


async def stop_shadow(
    redis: aioredis.Redis, keys: RedisKeys, model: str, reason: str = "stopped by an operator"
) -> ShadowState:
    """Mirror no more of ``model``'s requests; its last comparison stays readable."""
    current = await get_shadow(redis, keys, model)
    if current is None:
        raise NotFound(f"no shadow for model {model!r}", param="model")
    if current.status != "running":
        raise Conflict(f"the shadow of {model!r} is {current.status}, not running", param="model")
    state = current.model_copy(update={"status": "stopped", "reason": reason, "since": time.time()})
    await _put(redis, keys, state)
    return state
