"""The wire schema: what travels on Kafka topics and reply streams.

Every record carries ``v`` (schema version). Decoding validates and raises
``MalformedMessage`` naming the field, so a bad record is skipped, never fatal.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from laneway.constants import Band, RequestClass
from laneway.errors import MalformedMessage
from laneway.json_shape import json_problem

__all__ = [
    "BatchJob",
    "BatchRequest",
    "BatchResult",
    "CancelRecord",
    "ChatMessage",
    "KeyRevocation",
    "MemoryPressure",
    "Outcome",
    "Reply",
    "RequestEnvelope",
    "ScalingDecision",
    "UsageEvent",
    "cancel_key",
    "decode",
]

# ``rejected``: the engine refused the request for what it asks (its team's doing; counted by
# the team's breaker). ``unsupported``: the route's engine does not have what it asks (a
# parameter such as ``suffix``): a 400 too, but neither counted nor charged.
Outcome = Literal[
    "ok", "error", "cancelled", "superseded", "expired", "aborted", "rejected", "unsupported"
]
ApiKind = Literal["completion", "chat"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


M = TypeVar("M", bound=_Wire)

MAX_JOB_ID_CHARS = 200
MAX_CUSTOM_ID_CHARS = 500  # a batch line's id (its custom_id)
MAX_USAGE_TOKENS = 10**9  # one request's count: far above any context a model has
# One request's time, in ms: a year is far above any wait, run or re-run a request can have
# (a batch line waits days at most), and a rollup hour's sum of them stays finite.
MAX_USAGE_MS = 366 * 86_400_000.0
LAST_USAGE_TS = 4_102_444_800.0  # 2100-01-01 UTC


class ChatMessage(_Wire):
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="an assistant's calls: OpenAI's {id, type, function}"
    )
    tool_call_id: str | None = Field(None, description="a tool message's: the call it answers")
    name: str | None = Field(None, description="the participant's name, as the client sent it")

    def wire(self) -> dict[str, Any]:
        """As OpenAI's message: a tool call's content is null when it has no text."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            message["content"] = self.content or None
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class RequestEnvelope(_Wire):
    """One request on ``laneway.req.<class>.<band>``, keyed by ``affinity``."""

    v: Literal[1] = 1
    id: str = Field(min_length=1)
    team: str = Field(min_length=1)
    cls: RequestClass = Field(alias="class")
    band: Band = "hi"
    kind: ApiKind
    model: str = Field(min_length=1, description="the model the client asked for")
    route: str = Field(min_length=1, description="the model that serves it")
    prompt: str = ""
    suffix: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = Field(gt=0)
    max_tokens_default: bool = Field(
        False,
        description="the client set no max_tokens, or its class's cap or more: max_tokens is "
        "the cap (a server whose context has less room after the prompt gives it that room "
        "instead)",
    )
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(
        None, description="the client's sampling seed; None: the request's own"
    )
    stream: bool = False
    session: str | None = None
    seq: int | None = None
    affinity: str = Field(min_length=1)
    reply_to: str | None = Field(None, description="Redis reply stream; None: results topic")
    ingress: str | None = Field(
        None,
        description="the ingress process that holds its client's connection (its roll call "
        "name); None: the replica of reply_to",
    )
    accepted_ts: float = Field(description="epoch seconds the ingress accepted it")
    deadline_ts: float | None = Field(None, description="epoch seconds; drop if not started")
    prompt_tokens: int = Field(0, ge=0, description="the ingress estimate")
    job_id: str | None = None
    line_id: str | None = None
    quota_leased: int = Field(
        0,
        ge=0,
        description="tokens the ingress admitted it for from its quota lease (settled against "
        "the team's interactive pool); 0: a reservation in Redis, or no quota",
    )
    quota_local: int = Field(
        0,
        ge=0,
        description="tokens the ingress's local limiter admitted it for while Redis did not "
        "answer (nothing was taken from the pool: its settlement charges what it used); 0: none",
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="a chat's function tools, as OpenAI's; None: none"
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto, required or a named function; None: the engine's default"
    )
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="a chat's JSON output (OpenAI's json_object or json_schema); None: text"
    )
    unset: list[str] = Field(
        default_factory=list,
        description="sampling fields the client did not set (temperature, top_p): their values "
        "here are laneway's defaults, and an upstream server is sent none (it uses its own, "
        "as vLLM its model's)",
    )
    supersede_grace_tokens: int = Field(
        0,
        ge=0,
        description="a superseded request that already streamed this many tokens "
        "may finish (0: drop at once)",
    )
    reuse: bool = Field(
        False,
        description="type-through: it may be served from its session's running or recent "
        "generation, or an identical in-flight one of its team (its team's switch)",
    )
    shadow: bool = Field(
        False,
        description="a mirror of a client's request on a shadow route (laneway.shadow): no "
        "reply, no quota settlement, its usage event marked shadow",
    )

    def text_prompt(self) -> str:
        """The prompt as plain text (chat messages rendered one per line)."""
        if self.messages is None:
            return self.prompt
        return "".join(f"{m.role}: {m.content}\n" for m in self.messages) + "assistant: "


class CancelRecord(_Wire):
    """A cancel tombstone on the compacted ``laneway.cancel`` topic, keyed by team and
    request id (``cancel_key``).

    ``team`` is the team that asked; a worker honours it only for that team's requests.
    """

    v: Literal[1] = 1
    id: str = Field(min_length=1)
    team: str = Field(min_length=1)
    # ``ingress_gone``: a worker's own, never sent (``workers.ingress_watch``).
    reason: Literal["disconnect", "api", "ingress_gone"] = "api"
    ts: float = Field(default_factory=time.time)


def cancel_key(record: CancelRecord) -> bytes:
    """A tombstone's key on the compacted ``laneway.cancel`` topic: its team's and its
    request's. Keyed by the id alone, another team's tombstone of the same id (refused, but
    stored) was the one compaction kept, and a worker replaying the topic never saw the
    owner's."""
    return f"{record.team}\0{record.id}".encode(errors="surrogatepass")


class KeyRevocation(_Wire):
    """A revoked API key on the compacted ``laneway.keys`` topic, keyed by ``hash``.

    Only the key's SHA-256 travels: the key itself is never written anywhere.
    """

    v: Literal[1] = 1
    hash: str = Field(pattern="^[0-9a-f]{64}$")
    id: str
    team: str
    ts: float = Field(default_factory=time.time)


class Reply(_Wire):
    """One message on an ingress reply stream: a chunk of text and/or the terminal outcome.

    ``at`` is where this message's text starts in the request's whole text (in characters),
    so the ingress can drop what it already passed on when a worker restarted and ran the
    request again, however differently the re-run's text is cut into messages. ``n`` numbers
    the messages of one run; an ingress goes by it only for a worker that sends no ``at``
    (one from before offsets, during a rolling upgrade).

    ``status`` is what the client is answered by. Workers send an ``unsupported`` outcome
    (the usage event's) as ``rejected`` with its ``param``: the same 400 to every ingress,
    where one from before ``unsupported`` could not decode the reply at all.
    """

    id: str
    n: int = Field(ge=0, description="number of this message among the request's messages")
    at: int | None = Field(None, ge=0, description="offset of this text in the whole text")
    text: str = ""
    done: bool = False
    status: Outcome | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    route: str | None = None
    error: str | None = None
    param: str | None = Field(
        None, description="the request field an engine's refusal names (the client's 400)"
    )
    call_ids: dict[str, str] | None = Field(
        None,
        description="a chat with tools: the ids of the calls begun in its text so far, by "
        "index (its text frames the calls: ``laneway.tool_frames``)",
    )


class UsageEvent(_Wire):
    """One event per terminal outcome on ``laneway.usage``, keyed by team."""

    # JSON has no NaN or Infinity, yet the parser takes them: one in a sum made the hour's
    # rollup NaN, published as null and recovered from its changelog as None.
    model_config = ConfigDict(allow_inf_nan=False)

    v: Literal[1] = 1
    id: str
    team: str
    cls: RequestClass = Field(alias="class")
    model: str
    route: str
    status: Outcome
    # Bounded: a count no request can reach, or a time no clock shows, is a bad record,
    # skipped, not a bill of 10^18 tokens or a rollup hour in the year 3000.
    prompt_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    cached_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    completion_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    # Engine times are read on one clock (the engine's), never below 0. The waits span two
    # (acceptance by the ingress or the broker, the outcome by the worker): a little below 0
    # is the clocks' difference, not a bad record.
    engine_ms: float = Field(0.0, ge=0, le=MAX_USAGE_MS)
    stale_engine_ms: float = Field(
        0.0,
        ge=0,
        le=MAX_USAGE_MS,
        description="engine time used after the request turned stale (cancel/supersession)",
    )
    stale_news_ms: float = Field(
        0.0,
        ge=-MAX_USAGE_MS,
        le=MAX_USAGE_MS,
        description="for one that turned stale while running: how long the news took from "
        "the ingress to its worker (engine time in that gap is not in stale_engine_ms)",
    )
    queue_ms: float = Field(0.0, ge=-MAX_USAGE_MS, le=MAX_USAGE_MS)
    ttft_ms: float | None = Field(None, ge=-MAX_USAGE_MS, le=MAX_USAGE_MS)
    total_ms: float = Field(0.0, ge=-MAX_USAGE_MS, le=MAX_USAGE_MS)
    ts: float = Field(default_factory=time.time, gt=0, lt=LAST_USAGE_TS)
    worker: str | None = None
    error: str | None = None
    job_id: str | None = None
    reused_from: str | None = Field(
        None,
        description="served from this request's generation (type-through): no engine time "
        "of its own; its completion_tokens are what it received",
    )
    preempted: int = Field(
        0,
        ge=0,
        description="times it was aborted on the engine and queued again before this outcome "
        "(memory pressure, or a shared engine's batch making way for interactive work); the "
        "engine time of those attempts is not in engine_ms",
    )
    shadow: bool = Field(
        False,
        description="a shadow route's mirror of request <id minus '-shadow'>: not billed, not "
        "in quotas, budgets or breakers; only the shadow comparison counts it",
    )
    accepted_ts: float | None = Field(
        None,
        description="when the request was accepted (a batch line: when its record was stored), "
        "the same on every run of it: a worker's re-run repeats it, another request that "
        "reuses the id (a batch line sent again, another team's line of the same ids) does not",
    )


class BatchRequest(_Wire):
    """One line of a batch job, keyed ``<job_id>:<line_id>``, on ``laneway.req.batch`` or on a
    team's own topic ``<prefix>.req.batch.team.<team>``.

    ``team`` is the team the line runs and is charged for. It is taken from the door the line
    came through: the authenticated API key at ``POST /v1/batches``, a batch service
    principal whose ACL lets it write ``laneway.req.batch`` (an operator's pipeline), or the
    topic of a team's own principal, whose ACL lets it write that topic alone (there a
    ``team`` in the line is not read). No key travels with the line.
    ``body`` is the OpenAI request body of ``url``. A line the submitter could not parse
    carries ``error`` instead of a body and comes back as an error result.
    """

    v: Literal[1] = 1
    job_id: str = Field(min_length=1, max_length=MAX_JOB_ID_CHARS)
    line_id: str = Field(
        min_length=1, max_length=MAX_CUSTOM_ID_CHARS, description="the line's custom_id"
    )
    team: str | None = Field(None, min_length=1, max_length=200)
    api_key: str | None = Field(
        None,
        description="lines written before teams were named here carried the team's key; "
        "still read (so a line queued before an upgrade runs), never written",
    )
    url: Literal["/v1/completions", "/v1/chat/completions"] = "/v1/chat/completions"
    body: dict[str, Any] | None = None
    error: str | None = None
    submitted_ts: float = Field(default_factory=time.time)

    @field_validator("body")
    @classmethod
    def _carried(cls, body: dict[str, Any] | None) -> dict[str, Any] | None:
        # A record written straight to Kafka is checked as the doors check a line: one that
        # could not be written out again is answered with the error, not retried forever.
        if body is not None and (problem := json_problem(body)) is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        return body

    def to_json(self) -> bytes:
        # A key is never written back: a re-queued legacy line leaves it behind.
        return self.model_dump_json(by_alias=True, exclude={"api_key"}).encode()


class BatchJob(_Wire):
    """The header of a job on ``laneway.results.batch`` (key: job id): how many lines."""

    v: Literal[1] = 1
    type: Literal["job"] = "job"
    job_id: str
    team: str
    lines: int = Field(ge=0)
    source: str = ""
    submitted_ts: float = Field(default_factory=time.time)


class BatchResult(_Wire):
    """The result of one line on ``laneway.results.batch`` (key: job id), written exactly once."""

    v: Literal[1] = 1
    type: Literal["result"] = "result"
    job_id: str
    line_id: str
    request_id: str
    team: str = ""
    status: Outcome
    status_code: int
    body: dict[str, Any] | None = Field(None, description="OpenAI response or error body")
    ts: float = Field(default_factory=time.time)


class ScalingDecision(_Wire):
    """A pool's desired replica count (``workers.scaling``): on ``laneway.control``, keyed by
    ``subject``, when it changes, and in Redis (``RedisKeys.scaling``) at every heartbeat."""

    v: Literal[1] = 1
    kind: Literal["scaling"] = "scaling"
    subject: str = Field(min_length=1, description="scaling:<pool>")
    pool: RequestClass
    desired: int = Field(ge=0)
    previous: int | None = Field(None, ge=0, description="the last desired count published")
    replicas: int = Field(ge=0, description="live workers of the pool (heartbeats)")
    raw: int = Field(ge=0, description="desired by the load now, before the scale-down window")
    reason: str = ""
    lag: int = Field(0, ge=0)
    lag_growth: float = Field(0.0, description="records per second")
    queued: int = Field(0, ge=0)
    running: int = Field(0, ge=0)
    capacity: int = Field(0, ge=0)
    kv_cache_usage: float = Field(0.0, ge=0)
    ts: float = Field(default_factory=time.time)


class MemoryPressure(_Wire):
    """A worker's engine came under memory pressure or out of it (``workers.memory``): on
    ``laneway.control``, keyed by ``subject``."""

    v: Literal[1] = 1
    kind: Literal["memory"] = "memory"
    subject: str = Field(min_length=1, description="memory:<worker id>")
    pool: RequestClass
    worker: str
    pressed: bool = Field(description="true: it began (shedding); false: it ended")
    kv_cache_usage: float = Field(ge=0)
    shed_at: float = Field(gt=0, le=1)
    resume_at: float = Field(gt=0, le=1)
    shed: int = Field(0, ge=0, description="requests shed since the pressure began")
    ts: float = Field(default_factory=time.time)


def decode(model: type[M], raw: bytes | str | None, *, strict: bool = False) -> M:
    """Validate one record; ``MalformedMessage`` names the first bad field. ``strict``: each
    field of the JSON type it is written as (no ``"100"`` or ``true`` for a count)."""
    if raw is None:
        raise MalformedMessage(f"empty {model.__name__} record")
    try:
        return model.model_validate_json(raw, strict=strict)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "<record>"
        reason = err["msg"].removeprefix("Value error, ")
        raise MalformedMessage(f"bad {model.__name__} record: {where}: {reason}") from None
