"""The one exception tree of laneway.

Every error a caller may act on carries its data and a ``retriable`` flag (like aiokafka's
``KafkaError``). Outcomes that are not failures (stale, superseded, expired work) are
``Dropped`` subclasses and are never logged as errors.

Each class also carries what the HTTP door answers with: ``status_code``, OpenAI's error
``error_type`` and ``code``, the ``kind`` label of ``laneway_errors_total``, and ``headers()``;
the ingress maps an error by reading them, never by testing its class.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

__all__ = [
    "Aborted",
    "AdminKeyGuesses",
    "BadRequest",
    "BodyTooLarge",
    "BodyTooSlow",
    "Cancelled",
    "ConfigError",
    "Conflict",
    "Dropped",
    "DroppedStatus",
    "DuplicateLine",
    "EngineError",
    "EngineFull",
    "EngineRejected",
    "EngineUnsupported",
    "Expired",
    "LanewayError",
    "MalformedMessage",
    "ModelNotFound",
    "NotFound",
    "ProbeFailed",
    "PromptTooLarge",
    "QuotaExceeded",
    "RateLimited",
    "ServiceError",
    "ServiceUnavailable",
    "Superseded",
    "Unauthorized",
]


class LanewayError(Exception):
    """Root of every error laneway raises on purpose."""

    retriable: bool = False
    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    kind: str = "other"
    param: str | None = None
    request_id: str | None = None  # set once the request has an id: the response names it

    def headers(self) -> dict[str, str]:
        """Response headers that go with this error (``Retry-After`` and the like)."""
        return {}


class ConfigError(LanewayError):
    """A setting is missing, misspelt or out of range; raised at start-up."""


class ServiceError(LanewayError):
    """A local service (Kafka broker, Redis server) could not be started or reached."""

    retriable = True


class BadRequest(LanewayError):
    """The caller sent something we cannot serve; ``param`` names the offending field."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"
    kind = "bad_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLarge(BadRequest):
    """A request longer than the context, answered as OpenAI answers it: 400
    ``context_length_exceeded``, its message naming the limit in OpenAI's words."""

    code = "context_length_exceeded"

    def __init__(
        self, limit: int, detail: str, *, param: str | None = None, setting: str | None = None
    ) -> None:
        message = detail
        if _OPENAI_CONTEXT_REFUSAL.search(detail) is None:
            where = f" ({setting})" if setting else ""
            message = f"This model's maximum context length is {limit} tokens{where}. {detail}"
        super().__init__(message, param=param)
        self.limit = limit

    @classmethod
    def from_engine(cls, reason: str, *, param: str | None) -> PromptTooLarge | None:
        """The engine's refusal ``reason`` as this error when it says, in the words of one of
        the servers below, that the request is over the model's context; else None."""
        for pattern in _CONTEXT_REFUSALS:
            if (found := pattern.search(reason)) is not None:
                return cls(int(found.group("limit")), reason, param=param)
        return None


# OpenAI's words, which vLLM serve uses too (for an over-long max_tokens as well, which
# OpenAI also answers with context_length_exceeded).
_OPENAI_CONTEXT_REFUSAL = re.compile(r"maximum context length is (?P<limit>\d+) tokens", re.I)
# What each server says when a request does not fit its context. Only these exact phrases:
# a guess ("too long", "context") would turn another refusal into this one.
_CONTEXT_REFUSALS = (
    _OPENAI_CONTEXT_REFUSAL,
    # vLLM's engine in process (AsyncLLM): "The decoder prompt (length 5000) is longer than
    # the maximum model length of 4096."
    re.compile(r"is longer than the maximum model length of (?P<limit>\d+)", re.I),
    # SGLang, now and before
    re.compile(r"exceeds the model's maximum context length of (?P<limit>\d+) tokens", re.I),
    re.compile(r"is longer than the model's context length \((?P<limit>\d+) tokens\)", re.I),
    # llama.cpp's server
    re.compile(r"exceeds the available context size \((?P<limit>\d+) tokens\)", re.I),
    # TGI
    re.compile(r"`inputs` tokens \+ `max_new_tokens` must be <= (?P<limit>\d+)"),
    re.compile(r"`inputs` must have less than (?P<limit>\d+) tokens"),
)


class BodyTooLarge(BadRequest):
    status_code = 413
    code = "request_too_large"


class BodyTooSlow(BadRequest):
    """A request body not complete within ``LANEWAY_READ_TIMEOUT_S``."""

    status_code = 408
    code = "request_timeout"


class ModelNotFound(BadRequest):
    status_code = 404
    code = "model_not_found"


class NotFound(BadRequest):
    status_code = 404
    code = "not_found"


# The official OpenAI SDKs send a 409 again (twice, by default: a lock timeout at
# OpenAI), unless the answer says not to.
_NOT_AGAIN = {"x-should-retry": "false"}
# A quota's wait longer than this is not worth a retry: no keystroke or chat is wanted a
# minute later (openai-node 6 sleeps any Retry-After; openai-python up to 120 s).
LONG_WAIT_S = 60


class Conflict(BadRequest):
    """The request contradicts what is already there (a canary already running)."""

    status_code = 409
    code = "conflict"

    def headers(self) -> dict[str, str]:
        return dict(_NOT_AGAIN)


class DuplicateLine(Conflict):
    """A batch line whose id another line of the worker still runs (a job sent twice)."""

    code = "duplicate_line"


class Unauthorized(LanewayError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"
    kind = "unauthorized"


class QuotaExceeded(LanewayError):
    """The team's pool cannot cover the reservation; retry after ``retry_after`` seconds."""

    retriable = True
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"
    kind = "quota"

    def __init__(
        self,
        message: str,
        *,
        team: str,
        limit: int,
        retry_after: float,
        never: bool = False,
        remaining: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.team = team
        self.limit = limit
        self.retry_after = retry_after
        self.never = never  # more than the whole budget: no wait makes it fit
        self.remaining = remaining  # tokens left in the pool (fewer than the request's)

    def headers(self) -> dict[str, str]:
        headers = {
            "x-ratelimit-limit-tokens": str(self.limit),
            "x-ratelimit-remaining-tokens": str(max(0, int(self.remaining))),
        }
        wait = max(1, math.ceil(self.retry_after))
        if self.never:
            # The SDKs retry a 429; no wait makes this one fit. And no Retry-After: clients
            # that read only it (Continue's backoff) would wait its hour, five times over.
            headers.update(_NOT_AGAIN)
        elif wait > LONG_WAIT_S:
            # Minutes: no client wants its request answered then, and openai-node (6.x)
            # sleeps a Retry-After whatever its length, past its own timeout. Told not to
            # retry, with the wait in the reset header (and the message).
            headers.update(_NOT_AGAIN)
            headers["x-ratelimit-reset-tokens"] = f"{wait}s"
        else:
            headers["Retry-After"] = str(wait)
            headers["x-ratelimit-reset-tokens"] = f"{wait}s"
        return headers


class RateLimited(QuotaExceeded):
    """Too many calls of one kind in a second (cancels by id); ``limit`` is calls a second,
    not tokens."""

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class AdminKeyGuesses(RateLimited):
    """Too many wrong admin keys on this replica (``ingress.admin_guesses``)."""

    kind = "admin_guesses"


class ServiceUnavailable(LanewayError):
    """A dependency or a breaker refuses the request for now."""

    retriable = True
    status_code = 503
    error_type = "service_unavailable"
    code = "service_unavailable"
    kind = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class EngineError(LanewayError):
    """The inference engine failed on one request."""

    retriable = True
    status_code = 502
    error_type = "engine_error"
    code = "engine_error"
    kind = "engine"


class EngineFull(EngineError):
    """The engine had no room for the request (an upstream's 429 or 503): it never started,
    and the worker queues it again, to send no more for ``retry_after`` seconds. Only a
    worker that does not know it treats it as the engine error it also is."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRejected(EngineError):
    """The engine refused the request itself (a prompt over its context, a value out of
    range): the client's doing, not a fault of the engine, and the same on every retry.
    ``param`` names the field at fault, where the engine can tell. A parameter the engine
    does not have at all is ``EngineUnsupported``."""

    retriable = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineUnsupported(EngineRejected):
    """The route's engine cannot do what the request asks (a parameter it does not have,
    named by ``param``): the client still gets a 400, yet the request is right (another
    engine serves it), so its team's breaker does not count it and it is not charged."""

    @classmethod
    def from_engine(cls, reason: str) -> EngineUnsupported | None:
        """The engine's refusal ``reason`` as this error when it says, in a known server's
        words, that it does not take a parameter; else None."""
        for pattern, param in _UNSUPPORTED_REFUSALS:
            if (found := pattern.search(reason)) is not None:
                return cls(reason, param=param or found.group("param"))
        return None


# What a server says when it does not take a parameter at all. Only these exact phrases: any
# other refusal is the request's own fault (``EngineRejected``) and is counted as one.
_UNSUPPORTED_REFUSALS: tuple[tuple[re.Pattern[str], str | None], ...] = (
    # vLLM serve refuses every completion with a suffix (it has no fill-in-the-middle).
    (re.compile(r"\b(?P<param>suffix) is not currently supported"), None),
    # vLLM serve started without a tool parser refuses the tool choice agents send.
    (re.compile(r'"auto" tool choice requires --enable-auto-tool-choice'), "tool_choice"),
    # ... and, since 0.3x, `required` and a named function too.
    (re.compile(r"tool_choice=.{1,300} requires --tool-call-parser to be set"), "tool_choice"),
    # llama.cpp's server without its Jinja templates (--no-jinja, or builds before 2025-11).
    (re.compile(r"tools param requires --jinja flag"), "tools"),
)


class MalformedMessage(LanewayError):
    """A Kafka record could not be decoded into the wire schema; it is skipped and counted."""


class ProbeFailed(LanewayError):
    """A synthetic probe reached the chain, which answered, but not with success."""

    retriable = True


# The outcomes of a request dropped or stopped short: each one of ``laneway.schema.Outcome``.
DroppedStatus = Literal["cancelled", "superseded", "expired", "aborted"]


class Dropped(LanewayError):
    """A request left without running to its end; not a failure. ``status`` is its outcome.

    ``engine_ms`` is the engine time it had already used (0 when dropped before running).
    """

    status: ClassVar[DroppedStatus]
    status_code = 409
    error_type = "request_dropped"
    kind = "dropped"

    def __init__(self, message: str, *, engine_ms: float = 0.0) -> None:
        super().__init__(message)
        self.engine_ms = engine_ms
        self.code = self.status

    def headers(self) -> dict[str, str]:
        # Sent again, a keystroke its next one superseded (or a request its client
        # cancelled) would reserve, queue and be dropped again, in the very storms the
        # shield is for.
        return dict(_NOT_AGAIN)


class Cancelled(Dropped):
    status = "cancelled"


class Superseded(Dropped):
    status = "superseded"


class Expired(Dropped):
    status = "expired"
    status_code = 504
    error_type = "timeout"
    kind = "timeout"

    def __init__(self, message: str, *, engine_ms: float = 0.0) -> None:
        super().__init__(message, engine_ms=engine_ms)
        self.code = "deadline_exceeded"

    def headers(self) -> dict[str, str]:
        return {}  # a 504: the SDK's retry (with its backoff) is the client's to choose


class Aborted(Dropped):
    """Stopped inside the engine after it had started (cancel or supersession mid-run)."""

    status = "aborted"
