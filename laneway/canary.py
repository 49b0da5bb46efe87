"""Canary routes: a new target for a model takes a growing share of its traffic, step by step.

One canary per model, kept in Redis as JSON at ``<prefix>:canary:<model>`` (the set
``<prefix>:canaries`` lists the models that have one). The ingress sends a request to the
canary's target when its *sticky key* falls under the current weight: the key is the team's
session when the client names one (``X-Laneway-Session``), else the request id, hashed with
the canary's secret salt to a bucket in [0, 100). A bucket under 1 % is also under 5 %, and
the salt is drawn once, when the canary starts, so as the weight grows sessions only ever
move from the stable route to the canary, never back, and within a step none moves at all.
The streams app moves the step (``streams/canary.py``); people start and abort it
(``laneway canary``, ``/admin/canary``).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import time
from collections.abc import Collection
from typing import Literal

import redis.asyncio as aioredis
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from laneway.constants import RedisKeys
from laneway.errors import BadRequest, Conflict, NotFound
from laneway.requests import check_served

__all__ = [
    "DEFAULT_STEPS",
    "CanaryState",
    "CanaryStatus",
    "abort_canary",
    "bucket",
    "canary_route",
    "delete_canary",
    "get_canary",
    "list_canaries",
    "parse_steps",
    "put_canary",
    "start_canary",
]

CanaryStatus = Literal["running", "promoted", "rolled_back", "aborted"]
DEFAULT_STEPS = (1.0, 5.0, 10.0, 100.0)


def parse_steps(text: str) -> tuple[float, ...]:
    """``"1,5,10,100"`` → (1.0, 5.0, 10.0, 100.0); rising weights in (0, 100], ending at 100."""
    try:
        steps = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BadRequest(
            f"steps must be comma-separated percentages like 1,5,10,100, not {text!r}",
            param="steps",
        ) from None
    return _checked(steps)


def _checked(steps: tuple[float, ...]) -> tuple[float, ...]:
    if not steps:
        raise BadRequest("steps: at least one weight", param="steps")
    if any(not 0 < w <= 100 for w in steps):
        raise BadRequest(f"steps: each weight in (0, 100], got {list(steps)}", param="steps")
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise BadRequest(f"steps must rise, got {list(steps)}", param="steps")
    if steps[-1] != 100:
        raise BadRequest(
            f"steps must end at 100 (full promotion), got {list(steps)}", param="steps"
        )
    return steps


class CanaryState(BaseModel):
    """Where a model's canary stands. ``weight`` is the share (%) of sticky keys it takes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, max_length=200)
    target: str = Field(min_length=1, max_length=200)
    steps: tuple[float, ...] = DEFAULT_STEPS
    step: int = Field(0, ge=0)
    status: CanaryStatus = "running"
    started: float = Field(default_factory=time.time)
    since: float = Field(default_factory=time.time)  # when the current step (or status) began
    reason: str = ""
    # Drawn when the canary starts, kept for its life, never shown (admin API, CLI, console):
    # with the bare hash a team could compute which of its sessions land on the canary and
    # send the few requests a step is judged on itself (slow prompts to roll it back, cheap
    # successes to promote it) for every team. "" (a record from before): the bare hash.
    salt: str = Field("", repr=False)

    @field_validator("steps")
    @classmethod
    def _steps(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        return _checked(tuple(steps))

    @model_validator(mode="after")
    def _consistent(self) -> CanaryState:
        if self.target == self.model:
            raise BadRequest("a canary's target must differ from the model", param="target")
        if self.step >= len(self.steps):
            raise BadRequest(f"step {self.step} of {len(self.steps)} steps", param="step")
        return self

    @property
    def weight(self) -> float:
        """The share (%) of traffic on the target now: 0 unless running, 100 once promoted."""
        if self.status == "promoted":
            return 100.0
        return self.steps[self.step] if self.status == "running" else 0.0

    def advanced(self, now: float) -> CanaryState:
        """The next step; the last (100 %) is the promotion itself."""
        last = len(self.steps) - 1
        if self.step + 1 >= last:
            return self.model_copy(
                update={"status": "promoted", "step": last, "since": now, "reason": ""}
            )
        return self.model_copy(update={"step": self.step + 1, "since": now})

    def ended(self, status: CanaryStatus, reason: str, now: float) -> CanaryState:
        return self.model_copy(update={"status": status, "reason": reason, "since": now})

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


def bucket(team: str, sticky: str, salt: str = "") -> float:
    """Where a sticky key falls in [0, 100): the same for the same key and salt, everywhere."""
    key = f"{salt}\0{sticky}" if salt else sticky
    digest = hashlib.blake2b(f"{team}\0{key}".encode(errors="surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") / 2**64 * 100


def canary_route(state: CanaryState | None, team: str, sticky: str) -> str | None:
    """The canary's target when this key's bucket is under the weight; None: stay stable."""
    if state is None or state.weight <= 0:
        return None
    return state.target if bucket(team, sticky, state.salt) < state.weight else None


async def get_canary(redis: aioredis.Redis, keys: RedisKeys, model: str) -> CanaryState | None:
    raw = await redis.get(keys.canary(model))
    return CanaryState.model_validate_json(raw) if raw else None


async def list_canaries(redis: aioredis.Redis, keys: RedisKeys) -> list[CanaryState]:
    members = await redis.smembers(keys.canaries())
    models = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
    if not models:
        return []
    raws = await redis.mget([keys.canary(m) for m in models])
    return [CanaryState.model_validate_json(raw) for raw in raws if raw]


async def put_canary(redis: aioredis.Redis, keys: RedisKeys, state: CanaryState) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(keys.canary(state.model), state.to_json())
        pipe.sadd(keys.canaries(), state.model)
        await pipe.execute()


async def delete_canary(redis: aioredis.Redis, keys: RedisKeys, model: str) -> None:
    """Forget a model's canary (its record and its place in the list)."""
    if not await redis.exists(keys.canary(model)):
        raise NotFound(f"no canary for model {model!r}", param="model")
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(keys.canary(model))
        pipe.srem(keys.canaries(), model)
        await pipe.execute()


async def start_canary(
    redis: aioredis.Redis,
    keys: RedisKeys,
    model: str,
    target: str,
    steps: tuple[float, ...] = DEFAULT_STEPS,
    *,
    served: Collection[str] | None = None,
) -> CanaryState:
    """Start ``model``'s canary on ``target`` at its first step; one running canary a model.
    ``served``: the models clients may ask for (a canary of another would show "running"
    for ever, with no traffic); None: not checked."""
    try:  # the caller's input (a name too long or empty, bad steps), before Redis is asked
        state = CanaryState(
            model=model, target=target, steps=steps, since=0.0, salt=secrets.token_hex(16)
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "model"
        raise BadRequest(f"{field}: {error['msg']}", param=field) from None
    if served is not None:
        check_served(model, served)
    current = await get_canary(redis, keys, model)
    if current is not None and current.status == "running":
        raise Conflict(
            f"model {model!r} already has a canary running (→ {current.target} at "
            f"{current.weight:g} %); abort it first",
            param="model",
        )
    seconds, micros = await redis.time()  # Redis's clock, which the streams app judges on
    state = state.model_copy(update={"since": seconds + micros / 1e6})
    await put_canary(redis, keys, state)
    return state


async def abort_canary(
    redis: aioredis.Redis, keys: RedisKeys, model: str, reason: str = "aborted by an operator"
) -> CanaryState:
    """Send all of ``model``'s traffic back to the stable route at once."""
    current = await get_canary(redis, keys, model)
    if current is None:
        raise NotFound(f"no canary for model {model!r}", param="model")
    if current.status != "running":
        raise Conflict(f"the canary of {model!r} is {current.status}, not running", param="model")
    state = current.ended("aborted", reason, time.time())
    await put_canary(redis, keys, state)
    return state
