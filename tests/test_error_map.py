"""Each laneway error reaches the client as what it carries: status, OpenAI type and code,
headers, and one bounded kind on ``laneway_errors_total`` (in-process: no service needed)."""

from __future__ import annotations

import orjson
import pytest

from ingress.errors import error_response
from ingress.reply_delivery import reply_error
from laneway.errors import (
    Aborted,
    BadRequest,
    ConfigError,
    EngineError,
    Expired,
    LanewayError,
    ModelNotFound,
    PromptTooLarge,
    QuotaExceeded,
    RateLimited,
    ServiceUnavailable,
    Superseded,
    Unauthorized,
)
from laneway.metrics import ERRORS
from laneway.schema import Reply


def counted(kind: str) -> float:
    return ERRORS.labels(kind)._value.get()


@pytest.mark.parametrize(
    ("error", "status", "type_", "code", "kind"),
    [
        (BadRequest("max_tokens: too big", param="max_tokens"), 400, "invalid_request_error",
         "invalid_request", "bad_request"),
        (ModelNotFound("no model x"), 404, "invalid_request_error", "model_not_found",
         "bad_request"),
        (Unauthorized("bad key"), 401, "authentication_error", "invalid_api_key", "unauthorized"),
        (ServiceUnavailable("breaker", retry_after=2.4), 503, "service_unavailable",
         "service_unavailable", "unavailable"),
        (Expired("deadline passed"), 504, "timeout", "deadline_exceeded", "timeout"),
        (Superseded("seq 3 of s"), 409, "request_dropped", "superseded", "dropped"),
        (Aborted("cancelled mid-run"), 409, "request_dropped", "aborted", "dropped"),
        (EngineError("engine died"), 502, "engine_error", "engine_error", "engine"),
        (ConfigError("bad setting"), 500, "server_error", None, "other"),
    ],
)  # fmt: skip
def test_an_error_maps_to_what_it_carries(
    error: LanewayError, status: int, type_: str, code: str | None, kind: str
) -> None:
    before = counted(kind)
    response = error_response(error)
    body = orjson.loads(bytes(response.body))["error"]
    assert response.status_code == status
    assert (body["type"], body["code"], body["message"]) == (type_, code, str(error))
    assert body["param"] == error.param
    assert counted(kind) == before + 1


def test_quota_errors_say_when_to_retry_and_what_the_limit_is() -> None:
    tokens = error_response(
        QuotaExceeded("pool empty", team="a", limit=5000, retry_after=0.2, remaining=7.5)
    )
    assert tokens.status_code == 429
    assert tokens.headers["Retry-After"] == "1"  # never 0: a client would spin
    assert tokens.headers["x-ratelimit-reset-tokens"] == "1s"
    assert tokens.headers["x-ratelimit-limit-tokens"] == "5000"
    assert tokens.headers["x-ratelimit-remaining-tokens"] == "7"  # not 0: 7 left, too few
    assert "x-should-retry" not in tokens.headers
    # A wait of minutes is no retry's: openai-node 6 slept the whole Retry-After.
    hour = error_response(QuotaExceeded("pool empty", team="a", limit=5000, retry_after=779.2))
    assert hour.headers["x-should-retry"] == "false"
    assert "Retry-After" not in hour.headers
    assert hour.headers["x-ratelimit-reset-tokens"] == "780s"
    calls = error_response(RateLimited("cancels", team="a", limit=50, retry_after=2.5))
    assert calls.headers["Retry-After"] == "3"
    assert "x-ratelimit-limit-tokens" not in calls.headers  # its limit is calls, not tokens
    unavailable = error_response(ServiceUnavailable("breaker", retry_after=2.4))
    assert unavailable.headers["Retry-After"] == "2"


@pytest.mark.parametrize("status", ["cancelled", "superseded", "aborted", "expired"])
def test_a_dropped_reply_keeps_its_outcome_as_code_and_says_whether_to_send_it_again(
    status: str,
) -> None:
    """Streamed or not, the client reads the same code (an abort mid-run was ``dropped``
    unstreamed, ``aborted`` in the stream). A drop is not to be sent again (the OpenAI SDKs
    retry a 409 unless told not to); a 504 is the client's to retry."""
    error = reply_error(Reply(id="r", n=0, done=True, status=status, error="why"), kind="chat")
    response = error_response(error)
    code = orjson.loads(bytes(response.body))["error"]["code"]
    if status == "expired":
        assert (response.status_code, code) == (504, "deadline_exceeded")
        assert "x-should-retry" not in response.headers
    else:
        assert (response.status_code, code) == (409, status)
        assert response.headers["x-should-retry"] == "false"


def test_an_error_of_a_request_names_it_as_openai_does() -> None:
    """The OpenAI SDKs read ``x-request-id`` (``APIStatusError.request_id``); laneway's own
    header carries the same id."""
    error = EngineError("engine died")
    error.request_id = "cmpl-1"
    response = error_response(error)
    assert response.headers["x-request-id"] == response.headers["x-laneway-request-id"]
    assert response.headers["x-request-id"] == "cmpl-1"
    assert "x-request-id" not in error_response(BadRequest("no id yet")).headers


def test_a_prompt_over_the_limit_is_openais_400_context_length_exceeded() -> None:
    response = error_response(
        PromptTooLarge(1000, "The prompt is about 2000 tokens.", param="prompt")
    )
    body = orjson.loads(bytes(response.body))["error"]
    assert response.status_code == 400
    assert (body["type"], body["code"], body["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        "prompt",
    )
    assert body["message"].startswith("This model's maximum context length is 1000 tokens.")


# What servers say when a request is longer than the model's context (the limit: 4096).
CONTEXT_REFUSALS = [
    # OpenAI's own words, which vLLM serve repeats
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4990 in the messages, 10 in the completion). Please reduce the length of the messages.",
    # vLLM in process (AsyncLLM's ValueError)
    "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make "
    "sure that `max_model_len` is no smaller than the number of text tokens.",
    # SGLang, newer and older
    "Requested token count exceeds the model's maximum context length of 4096 tokens. You "
    "requested a total of 5000 tokens",
    "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
    # llama.cpp
    "request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it",
    # TGI
    '{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. '
    'Given: 4990 `inputs` tokens and 10 `max_new_tokens`","error_type":"validation"}',
    "Input validation error: `inputs` must have less than 4096 tokens. Given: 5000",
]


@pytest.mark.parametrize("said", CONTEXT_REFUSALS)
@pytest.mark.parametrize(("kind", "param"), [("completion", "prompt"), ("chat", "messages")])
def test_an_engines_context_refusal_is_openais_context_length_exceeded(
    said: str, kind: str, param: str
) -> None:
    reply = Reply(
        id="r", n=0, done=True, status="rejected", error=f"the engine refused the request: {said}"
    )
    response = error_response(reply_error(reply, kind=kind))
    body = orjson.loads(bytes(response.body))["error"]
    assert response.status_code == 400
    assert (body["code"], body["param"]) == ("context_length_exceeded", param)
    assert "maximum context length is 4096 tokens" in body["message"]
    assert said[:40] in body["message"]  # the engine's own words stay


def test_an_engines_other_refusals_stay_a_plain_400() -> None:
    for said in ("suffix is not currently supported", "temperature must be at most 2 (got 9)"):
        reply = Reply(id="r", n=0, done=True, status="rejected", error=said)
        response = error_response(reply_error(reply, kind="completion"))
        body = orjson.loads(bytes(response.body))["error"]
        assert (response.status_code, body["code"]) == (400, "invalid_request")
        assert body["message"] == said


@pytest.mark.parametrize("status", ["rejected", "unsupported"])
def test_an_engines_refusal_names_the_field_the_worker_reports(status: str) -> None:
    """The vllm engine refuses a suffix (``unsupported``; an older worker said ``rejected``):
    the client's 400 names the field, as OpenAI's do."""
    said = "suffix is not supported by this model's engine (vllm: no fill-in-the-middle)"
    reply = Reply(id="r", n=0, done=True, status=status, error=said, param="suffix")
    response = error_response(reply_error(reply, kind="completion"))
    body = orjson.loads(bytes(response.body))["error"]
    assert response.status_code == 400
    assert (body["type"], body["param"], body["message"]) == (
        "invalid_request_error",
        "suffix",
        said,
    )
