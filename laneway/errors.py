"""The one exception tree of laneway.

Every error a caller may act on carries its data and a ``retriable`` flag (like aiokafka's
``KafkaError``). Outcomes that are not failures (stale, superseded, expired work) are
``Dropped`` subclasses and are never logged as errors.
"""

from __future__ import annotations

__all__ = [
    "Aborted",
    "BadRequest",
    "BodyTooLarge",
    "Cancelled",
    "ConfigError",
    "Dropped",
    "EngineError",
    "EngineRejected",
    "Expired",
    "LanewayError",
    "MalformedMessage",
    "ModelNotFound",
    "NotFound",
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


class ConfigError(LanewayError):
    """A setting is missing, misspelt or out of range; raised at start-up."""


class ServiceError(LanewayError):
    """A local service (Kafka broker, Redis server) could not be started or reached."""

    retriable = True


class BadRequest(LanewayError):
    """The caller sent something we cannot serve; ``param`` names the offending field."""

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLarge(BadRequest):
    status_code = 413
    code = "context_length_exceeded"


class BodyTooLarge(BadRequest):
    status_code = 413
    code = "request_too_large"


class ModelNotFound(BadRequest):
    status_code = 404
    code = "model_not_found"


class NotFound(BadRequest):
    status_code = 404
    code = "not_found"


class Unauthorized(LanewayError):
    status_code = 401
    code = "invalid_api_key"


class QuotaExceeded(LanewayError):
    """The team's pool cannot cover the reservation; retry after ``retry_after`` seconds."""

    retriable = True
    status_code = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, team: str, limit: int, retry_after: float) -> None:
        super().__init__(message)
        self.team = team
        self.limit = limit
        self.retry_after = retry_after


class RateLimited(QuotaExceeded):
    """Too many calls of one kind in a second (cancels by id); ``limit`` is calls a second,
    not tokens."""


class ServiceUnavailable(LanewayError):
    """A dependency or a breaker refuses the request for now."""

    retriable = True
    status_code = 503
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineError(LanewayError):
    """The inference engine failed on one request."""

    retriable = True


class EngineRejected(EngineError):
    """The engine refused the request itself (a prompt over its context, parameters it does
    not take): the client's doing, not a fault of the engine, and the same on every retry."""

    retriable = False


class MalformedMessage(LanewayError):
    """A Kafka record could not be decoded into the wire schema; it is skipped and counted."""


class Dropped(LanewayError):
    """A request left without running to its end; not a failure. ``status`` is its outcome.

    ``engine_ms`` is the engine time it had already used (0 when dropped before running).
    """

    status = "dropped"

    def __init__(self, message: str, *, engine_ms: float = 0.0) -> None:
        super().__init__(message)
        self.engine_ms = engine_ms


class Cancelled(Dropped):
    status = "cancelled"


class Superseded(Dropped):
    status = "superseded"


class Expired(Dropped):
    status = "expired"


class Aborted(Dropped):
    """Stopped inside the engine after it had started (cancel or supersession mid-run)."""

    status = "aborted"
