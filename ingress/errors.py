"""Domain errors become HTTP responses here and nowhere else, in OpenAI's error shape.

No body carries what a backing service said: a Redis or Kafka error that escapes a route is
a 503 that names no server and quotes no exception (the log has it), and anything else that
escapes is a 500 with the same discretion.
"""

from __future__ import annotations

import logging
import math

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ingress.responses import JSONResponse, error_body
from laneway.errors import (
    BadRequest,
    Dropped,
    EngineError,
    Expired,
    LanewayError,
    QuotaExceeded,
    RateLimited,
    ServiceUnavailable,
    Unauthorized,
)
from laneway.metrics import ERRORS

__all__ = ["error_response", "install_error_handlers"]

# Error kinds of laneway_errors_total (bounded: one per class of the error tree).
_KINDS: dict[type[LanewayError], str] = {
    BadRequest: "bad_request",
    Unauthorized: "unauthorized",
    QuotaExceeded: "quota",
    ServiceUnavailable: "unavailable",
    Expired: "timeout",
    EngineError: "engine",
}

log = logging.getLogger(__name__)


def error_response(exc: LanewayError) -> Response:
    """The one map from laneway errors to status, headers and body."""
    kind = next((_KINDS[c] for c in type(exc).__mro__ if c in _KINDS), "other")
    ERRORS.labels(kind).inc()
    headers: dict[str, str] = {}
    if isinstance(exc, BadRequest):
        status, type_, code, param = exc.status_code, "invalid_request_error", exc.code, exc.param
        message = exc.message
    elif isinstance(exc, Unauthorized):
        status, type_, code, param, message = 401, "authentication_error", exc.code, None, str(exc)
    elif isinstance(exc, QuotaExceeded):
        status, type_, code, param, message = 429, "rate_limit_error", exc.code, None, str(exc)
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        if not isinstance(exc, RateLimited):  # its limit is calls a second, not tokens
            headers["x-ratelimit-limit-tokens"] = str(exc.limit)
            headers["x-ratelimit-remaining-tokens"] = "0"
    elif isinstance(exc, ServiceUnavailable):
        status, type_, code, param, message = 503, "service_unavailable", exc.code, None, str(exc)
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif isinstance(exc, Expired):
        status, type_, code, param, message = 504, "timeout", "deadline_exceeded", None, str(exc)
    elif isinstance(exc, Dropped):
        status, type_, code, param, message = 409, "request_dropped", exc.status, None, str(exc)
    elif isinstance(exc, EngineError):
        status, type_, code, param, message = 502, "engine_error", "engine_error", None, str(exc)
    else:
        status, type_, code, param, message = 500, "server_error", None, None, str(exc)
    return JSONResponse(
        error_body(message, type_=type_, code=code, param=param),
        status_code=status,
        headers=headers,
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_laneway_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, LanewayError)
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if p != "body")
        return error_response(BadRequest(f"{field}: {err['msg']}", param=field))

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else None
        body = error_body(str(exc.detail), type_="invalid_request_error", code=code)
        return JSONResponse(body, status_code=exc.status_code)

    async def on_backend_error(request: Request, exc: Exception) -> Response:
        log.warning("%s %s: a backing service failed: %r", request.method, request.url.path, exc)
        return error_response(
            ServiceUnavailable("a backing service is unavailable; retry shortly", retry_after=2)
        )

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        ERRORS.labels("other").inc()
        body = error_body(
            "internal error; retry, or report the time of the request",
            type_="server_error",
            code=None,
        )
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(LanewayError, on_laneway_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    for backend in (RedisError, KafkaError, OSError):
        app.add_exception_handler(backend, on_backend_error)
    app.add_exception_handler(Exception, on_unexpected)
