"""An upstream that answers with something other than OpenAI's event stream: each request it
breaks still ends, at once, with an engine error its client sees, a usage event and a
settled reservation, and the worker goes on serving."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from laneway.constants import RedisKeys
from laneway.errors import EngineError, EngineRejected, EngineUnsupported
from laneway.schema import ChatMessage
from quota.enforcer import QuotaEnforcer
from quota.model import QuotaPolicy
from quota.teams import get_team
from tests.stack import LiveStack, clear_of_the_hour_turn, eventually
from workers.types import EngineRequest
from workers.upstream import OpenAICompatibleEngine

_WORDS = b'data: {"choices": [{"text": "half an "}]}\n\n'
# What the server streams for a prompt, and the words the usage event's error must have: an
# event that is not JSON, JSON that is not an object, choices that are not objects, an error
# event midway (as vLLM ends a failed stream, [DONE] after it), a stream that stops with no
# finish_reason and no [DONE]; then a good one.
_BROKEN = {
    "not-json": (b"data: {oops\n\n", "not an OpenAI chunk"),
    "a-list": (b"data: [1, 2]\n\n", "not an OpenAI chunk"),
    "bad-choices": (b'data: {"choices": ["text"]}\n\n', "not an OpenAI chunk"),
    "error-midway": (
        _WORDS + b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n',
        "failed midway: engine died",
    ),
    "cut-short": (_WORDS, "ended before its end"),
}
_GOOD = b'data: {"choices": [{"text": "fine", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
_NOT_STREAMED = "json"  # answered with one JSON body, though a stream was asked for
# A prompt "finish:<reason>" (a chat message's content too) ends its stream with that reason.
_FINISH = "finish:"
# A prompt "usage:<json>" gets a good stream whose usage chunk is that JSON.
_USAGE = "usage:"
# How servers refuse a prompt longer than the model's context (4096 tokens), by prompt.
_OVER_CONTEXT = {
    "over-context-vllm": {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you requested "
        "5000 tokens (4992 in the messages, 8 in the completion). Please reduce the length of "
        "the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
    "over-context-llama": {
        "error": {
            "code": 400,
            "message": "request (5000 tokens) exceeds the available context size (4096 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 5000,
            "n_ctx": 4096,
        }
    },
}

# TGI refuses a request in a 200 stream, [DONE] after it (older SGLang and llama.cpp too).
_TGI_OVER_CONTEXT = (
    b'data: {"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= '
    b'4096. Given: 4990 `inputs` tokens and 10 `max_new_tokens`","error_type":"validation"}'
    b"\n\ndata: [DONE]\n\n"
)
# Error events by prompt, each [DONE] after it, and whether it refuses the request (it comes
# before any text, and says so) or is a failure midway.
_IN_STREAM = {
    "over-context-tgi": (_TGI_OVER_CONTEXT, True),
    "tgi-validation": (
        b'data: {"error":"Input validation error: `temperature` must be strictly positive",'
        b'"error_type":"validation"}\n\ndata: [DONE]\n\n',
        True,
    ),
    "llama-400": (
        b'data: {"error": {"code": 400, "message": "the request has a bad grammar", '
        b'"type": "invalid_request_error"}}\n\ndata: [DONE]\n\n',
        True,
    ),
    "status-422": (
        b'data: {"error": {"message": "bad n", "http_status_code": 422}}\n\ndata: [DONE]\n\n',
        True,
    ),
    # vLLM serve says 400 BadRequestError for any failure in a stream, a dead engine's too:
    # only its words can tell a refusal.
    "vllm-engine-dead": (
        b'data: {"error": {"object": "error", "message": "EngineCore encountered an issue", '
        b'"type": "BadRequestError", "param": null, "code": 400}}\n\ndata: [DONE]\n\n',
        False,
    ),
    "vllm-over-context": (
        b'data: {"error": {"object": "error", "message": "This model\'s maximum context length '
        b'is 4096 tokens. However, you requested 5000 tokens.", "type": "BadRequestError", '
        b'"param": null, "code": 400}}\n\ndata: [DONE]\n\n',
        True,
    ),
    "server-500": (
        b'data: {"error": {"code": 500, "message": "out of memory"}}\n\ndata: [DONE]\n\n',
        False,
    ),
    "validation-after-text": (_WORDS + _TGI_OVER_CONTEXT, False),
}
# vLLM serve's answer to any completion with a suffix (it has no fill-in-the-middle).
_NO_SUFFIX = {
    "object": "error",
    "message": "suffix is not currently supported",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == _NOT_STREAMED:
        return web.json_response({"choices": [{"text": "whole", "finish_reason": "stop"}]})
    if body["prompt"] in _OVER_CONTEXT:
        return web.json_response(_OVER_CONTEXT[body["prompt"]], status=400)
    if "suffix" in body:
        return web.json_response(_NO_SUFFIX, status=400)
    if body["prompt"].startswith(_FINISH):
        return await _finishing(request, body["prompt"].removeprefix(_FINISH), chat=False)
    if body["prompt"].startswith(_USAGE):
        usage = orjson.loads(body["prompt"].removeprefix(_USAGE))
        return await _finishing(request, "stop", chat=False, usage=usage)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    sent = _BROKEN.get(body["prompt"]) or _IN_STREAM.get(body["prompt"])
    await response.write(sent[0] if sent else _GOOD)
    await response.write_eof()
    return response


async def _chat(request: web.Request) -> web.StreamResponse:
    """A good chat stream that reports no usage (as some OpenAI-compatible servers do)."""
    content = (await request.json())["messages"][-1]["content"]
    if content.startswith(_FINISH):
        return await _finishing(request, content.removeprefix(_FINISH), chat=True)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"choices": [{"delta": {"content": "fine"}, "finish_reason": "stop"}]}
    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


async def _finishing(
    request: web.Request, reason: str, *, chat: bool, usage: dict[str, Any] | None = None
) -> web.StreamResponse:
    """Two words, the second chunk ending the stream with ``reason``, then ``usage`` (by
    default a good one) and [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for text, finish in (("one ", None), ("two", reason)):
        part = {"delta": {"content": text}} if chat else {"text": text}
        chunk = {"choices": [{"index": 0, **part, "finish_reason": finish}]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    usage = usage or {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@pytest.fixture
async def garbling() -> AsyncIterator[str]:
    """A real HTTP server on a free port that garbles the streams of ``_BROKEN``'s prompts."""
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_a_garbled_upstream_stream_ends_its_request_with_an_error(
    stack: LiveStack, garbling: str
) -> None:
    await clear_of_the_hour_turn(60)
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker(
        "completion", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-g", size=5))
    expected = {**{p: words for p, (_, words) in _BROKEN.items()}, _NOT_STREAMED: "not the event"}
    ids = {}
    for prompt, words in expected.items():
        body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 8}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 502, (prompt, answer.status_code, answer.text)
        assert "engine failed" in answer.json()["error"]["message"]
        ids[answer.headers["x-laneway-request-id"]] = words
    good = await http.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": "ok", "max_tokens": 8}
    )
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] == "fine"
    events = await stack.read_topic(
        stack.topics.usage, count=len(ids) + 1, where=lambda e: e["team"] == "team-g"
    )
    assert sorted(e["status"] for e in events) == ["error"] * len(ids) + ["ok"]
    for event in events:
        if event["id"] in ids:
            assert ids[event["id"]] in event["error"], event
    await _every_reservation_settled(stack, "team-g")


async def _every_reservation_settled(stack: LiveStack, team_name: str) -> None:
    """None is left holding the team's tokens."""
    keys = RedisKeys(stack.prefix)
    enforcer = QuotaEnforcer(stack.redis, keys, QuotaPolicy())
    team = await get_team(stack.redis, keys, team_name)

    async def settled() -> bool:
        pools: Any = (await enforcer.snapshot(team))["pools"]
        return bool(pools["interactive"]["reservations"] == 0)

    await eventually(settled, 10, "every reservation settled")


async def test_an_upstream_that_reports_no_usage_is_billed_the_ingress_estimate(
    stack: LiveStack, garbling: str
) -> None:
    """A chat's prompt is billed with its message framing (3 tokens a message and 3 for the
    reply, as the ingress estimated and reserved it) when the upstream gives no count."""
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker(
        "chat", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-u", size=5))
    messages = [{"role": "user", "content": "a"}] * 50
    answer = await http.post(
        "/v1/chat/completions",
        json={"model": "laneway-chat", "messages": messages, "max_tokens": 8},
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "fine"
    billed = answer.json()["usage"]["prompt_tokens"]
    assert billed >= 50 * 3 + 3, billed  # the framing alone, whatever the text's estimate
    (event,) = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda e: e["team"] == "team-u"
    )
    assert event["prompt_tokens"] == billed


async def test_usage_counts_an_upstream_cannot_mean_are_replaced_by_laneways_own(
    stack: LiveStack, garbling: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A null, negative, fractional or absurd count in the upstream's usage failed the usage
    event after the client had its answer: no event, no settlement, and a batch line passed
    over with no result. The answer stands; the counts are laneway's own."""
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker(
        "completion", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-n", size=5))
    odd = [
        {"prompt_tokens": None, "completion_tokens": 2},
        {"prompt_tokens": -3, "completion_tokens": 2},
        {"prompt_tokens": 3, "completion_tokens": 2.5},
        {"prompt_tokens": 10**12, "completion_tokens": True},
        {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": "x"},
        },
        {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 9}},
    ]
    with caplog.at_level(logging.WARNING, logger="workers.upstream_stream"):
        ids = []
        for usage in odd:
            prompt = _USAGE + orjson.dumps(usage).decode()
            answer = await http.post(
                "/v1/completions", json={"model": "laneway-code", "prompt": prompt, "max_tokens": 8}
            )
            assert answer.status_code == 200, (usage, answer.text)
            assert answer.json()["choices"][0]["text"] == "one two"
            ids.append(answer.headers["x-laneway-request-id"])
        events = await stack.usage_of(*ids)
    for usage, event in zip(odd, (events[i] for i in ids), strict=True):
        assert event["status"] == "ok", (usage, event)
        assert 0 < event["prompt_tokens"] < 1000, (usage, event)  # the estimate where odd
        assert event["completion_tokens"] == 2, (usage, event)  # the chunks, where odd
        assert 0 <= event["cached_tokens"] <= event["prompt_tokens"], (usage, event)
    assert "which is no token count" in caplog.text
    await _every_reservation_settled(stack, "team-n")


@pytest.fixture
async def upstream_engine(garbling: str) -> AsyncIterator[OpenAICompatibleEngine]:
    engine = OpenAICompatibleEngine(garbling, model="up", slots=4)
    await engine.start()
    yield engine
    await engine.stop()


async def _finish(engine: OpenAICompatibleEngine, reason: str, *, chat: bool = False) -> str:
    request = EngineRequest(id=f"r-{reason}", route="m", prompt=_FINISH + reason, max_tokens=8)
    if chat:
        message = ChatMessage(role="user", content=_FINISH + reason)
        request = EngineRequest(
            id=f"c-{reason}", route="m", prompt="", max_tokens=8, messages=[message]
        )
    deltas = [delta async for delta in engine.generate(request)]
    assert "".join(d.text for d in deltas) == "one two"
    return str(deltas[-1].finish_reason)


@pytest.mark.parametrize(
    ("sent", "told"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("content_filter", "content_filter"),
        ("eos_token", "stop"),  # TGI: the model ended its text
        ("stop_sequence", "stop"),  # TGI: a stop string ended it
    ],
)
async def test_an_upstreams_finish_reason_reaches_the_client_as_one_of_openais(
    upstream_engine: OpenAICompatibleEngine, sent: str, told: str
) -> None:
    assert await _finish(upstream_engine, sent) == told
    assert await _finish(upstream_engine, sent, chat=True) == told


async def test_tool_calls_is_a_chat_finish_reason_only(
    upstream_engine: OpenAICompatibleEngine,
) -> None:
    assert await _finish(upstream_engine, "tool_calls", chat=True) == "tool_calls"
    with pytest.raises(EngineError, match="tool_calls"):
        await _finish(upstream_engine, "tool_calls")


async def test_an_upstream_abort_or_an_unknown_finish_reason_is_an_engine_error_logged_once(
    upstream_engine: OpenAICompatibleEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang ends a request it aborted itself with ``abort``: the text is not a whole
    answer. A reason OpenAI does not have cannot go to the client as it is (its SDKs and
    generated clients check the value); each such request fails, the server's value is
    logged once, not once a request."""
    caplog.set_level(logging.WARNING, "workers.upstream_stream")
    for reason in ("abort", "abort", "wat", "wat"):
        with pytest.raises(EngineError, match=f"finish_reason {reason!r}"):
            await _finish(upstream_engine, reason)
    logged = [r.getMessage() for r in caplog.records if r.name == "workers.upstream_stream"]
    assert len([m for m in logged if "'abort'" in m]) == 1, logged
    assert len([m for m in logged if "'wat'" in m]) == 1, logged


async def test_an_upstreams_context_length_refusal_is_openais(
    stack: LiveStack, garbling: str
) -> None:
    """vLLM serve (OpenAI's own words) and llama.cpp (its own) refuse a prompt longer than
    the model's context: the client gets OpenAI's 400 ``context_length_exceeded``, naming
    the limit, as it would from OpenAI."""
    ingress = await stack.start_ingress()
    await stack.start_worker(
        "completion", engine="openai", upstream_url=garbling, upstream_model="up", upstream_slots=4
    )
    http = stack.http(ingress, await stack.api_key("team-c", size=5))
    ids = []
    # TGI says it inside a 200 stream, before any text: the same refusal, streamed or not.
    sent = [(prompt, False) for prompt in _OVER_CONTEXT]
    sent += [("over-context-tgi", False), ("over-context-tgi", True)]
    for prompt, stream in sent:
        body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 8, "stream": stream}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 400, (prompt, answer.text)
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "context_length_exceeded",
            "prompt",
        )
        assert "maximum context length is 4096 tokens" in error["message"], error
        assert "127.0.0.1" not in error["message"]  # the upstream's address is not the client's
        ids.append(answer.headers["x-request-id"])
    # The team's doing, not the route's: counted by the team's breaker alone.
    events = await stack.usage_of(*ids)
    assert {e["status"] for e in events.values()} == {"rejected"}


@pytest.mark.parametrize("prompt", list(_IN_STREAM))
async def test_an_error_event_before_any_text_that_refuses_the_request_is_a_refusal(
    upstream_engine: OpenAICompatibleEngine, prompt: str
) -> None:
    """TGI (and older SGLang and llama.cpp) refuse a request inside a 200 stream. Such an
    event before any text is the request's refusal (the client's 400), not an engine that
    failed midway (a 502, counted against the route)."""
    request = EngineRequest(id=f"r-{prompt}", route="m", prompt=prompt, max_tokens=8)
    with pytest.raises(EngineError) as failed:
        _ = [delta async for delta in upstream_engine.generate(request)]
    refused = _IN_STREAM[prompt][1]
    assert isinstance(failed.value, EngineRejected) is refused, failed.value
    assert not isinstance(failed.value, EngineUnsupported)
    said = "the engine refused the request" if refused else "failed midway"
    assert said in str(failed.value)


async def test_a_suffix_the_upstream_does_not_take_is_unsupported_naming_it(
    upstream_engine: OpenAICompatibleEngine,
) -> None:
    """vLLM serve refuses every completion with a suffix: the route's shortfall, not the
    request's fault (IDE plugins send one with every completion), named for the client."""
    request = EngineRequest(id="fim", route="m", prompt="def f(", suffix="x", max_tokens=8)
    with pytest.raises(EngineUnsupported, match="suffix is not currently supported") as refused:
        _ = [delta async for delta in upstream_engine.generate(request)]
    assert refused.value.param == "suffix"


async def test_an_empty_suffix_is_a_plain_completion_not_refused(
    upstream_engine: OpenAICompatibleEngine,
) -> None:
    """An IDE at the end of a file sends `suffix: ""`: nothing to fill in around, which a
    server without fill-in-the-middle (vLLM serve refuses the field whatever its value) serves
    as the plain completion it is."""
    request = EngineRequest(id="eof", route="m", prompt="def f(", suffix="", max_tokens=8)
    deltas = [delta async for delta in upstream_engine.generate(request)]
    assert deltas[-1].finish_reason == "stop"
