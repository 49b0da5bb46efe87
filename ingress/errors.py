"""Domain errors become HTTP responses here and nowhere else, in OpenAI's error shape.

No body carries what a backing service said: a Redis or Kafka error that escapes a route is
a 503 that names no server and quotes no exception (the log has it), and anything else that
escapes is a 500 with the same discretion.
"""

from __future__ import annotations

import logging

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ingress.responses import JSONResponse, error_body
from laneway.errors import BadRequest, LanewayError, ServiceUnavailable
from laneway.logs import described
from laneway.metrics import ERRORS
from laneway.openai_format import clipped

__all__ = ["error_response", "install_error_handlers"]

log = logging.getLogger(__name__)


# What laneway serves of OpenAI's API, said by a 404 of another of its paths.
_SERVED = (
    "/v1/chat/completions, /v1/completions, /v1/models, /v1/files, /v1/batches and "
    "DELETE /v1/requests/{id}"
)
_RESPONSES = (
    " (a client of the Responses API: use its chat completions, as the Vercel AI SDK's "
    "provider.chat(model))"
)


def error_response(exc: LanewayError) -> Response:
    """The one map from laneway errors to status, headers and body: what the error carries."""
    ERRORS.labels(exc.kind).inc()
    headers = exc.headers()
    if exc.request_id is not None:
        # The id a success carries too; x-request-id is what the OpenAI SDKs read
        # (APIStatusError.request_id).
        headers["x-request-id"] = headers["x-laneway-request-id"] = exc.request_id
    return JSONResponse(
        error_body(str(exc), type_=exc.error_type, code=exc.code, param=exc.param),
        status_code=exc.status_code,
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

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        path = request.url.path
        if exc.status_code == 404 and path.startswith("/v1/"):
            # An OpenAI API laneway does not serve (the Vercel AI SDK's default provider
            # calls /v1/responses): say what it serves, not a bare "Not Found".
            message = f"{clipped(path, 100)} is not served here; it serves {_SERVED}"
            if path.startswith("/v1/responses"):
                message += _RESPONSES
        body = error_body(message, type_="invalid_request_error", code=code)
        # Starlette's own headers stay: a 405's ``Allow`` names the methods the path takes.
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_backend_error(request: Request, exc: Exception) -> Response:
        log.warning(
            "%s %s: a backing service failed: %s", request.method, request.url.path, described(exc)
        )
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
