"""Every body laneway sends validates against OpenAI's published API description.

Clients in other languages are generated from that description, so a field it requires and
laneway leaves out breaks them even where the Python SDK shrugs. The schemas are a subset of
github.com/openai/openai-openapi (tests/data/openai_schemas.json; source commit inside),
extracted by scripts/openai_schemas.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from jsonschema import Draft202012Validator

from ingress.metrics import CLIENT_GONE, RESPONSES
from laneway.constants import RedisKeys
from laneway.openai_format import error_body, final_body
from laneway.schema import Reply
from scripts.openai_schemas import ROOTS, extract
from tests.stack import LiveStack, envelope, eventually, long_prompt

SPEC = json.loads((Path(__file__).parent / "data" / "openai_schemas.json").read_text())
COMPONENTS: dict[str, Any] = SPEC["components"]


def _chunk_components() -> dict[str, Any]:
    """The one deviation allowed: OpenAI streams ``CreateCompletionResponse`` objects for
    /v1/completions and itself sends ``finish_reason: null`` on every chunk but the last,
    yet its description gives that field no null (the chat chunk's schema does allow it).
    Only chunks with a null finish_reason are checked against this copy."""
    relaxed = copy.deepcopy(COMPONENTS)
    choice = relaxed["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]
    reason = choice["properties"]["finish_reason"]
    choice["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    return relaxed


CHUNK_COMPONENTS = _chunk_components()


def problems(body: object, name: str, components: dict[str, Any] = COMPONENTS) -> list[str]:
    """What in ``body`` breaks OpenAI's schema ``name`` (empty: it conforms)."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": components}
    return [
        f"{name} at /{'/'.join(str(p) for p in error.absolute_path)}: {error.message}"
        for error in Draft202012Validator(schema).iter_errors(body)
    ]


class Wire:
    """Collects every body a test sees with what breaks its schema, so one run lists all."""

    def __init__(self) -> None:
        self.checked: Counter[str] = Counter()
        self.failures: list[str] = []

    def check(self, what: str, body: object, name: str, *, before_last: bool = False) -> None:
        self.checked[f"{name} before the last" if before_last else name] += 1
        components = CHUNK_COMPONENTS if before_last else COMPONENTS
        self.failures += [f"{what}: {p}" for p in problems(body, name, components)]

    def check_chunk(self, what: str, chunk: dict[str, Any]) -> None:
        if chunk.get("object") == "chat.completion.chunk":
            self.check(what, chunk, "CreateChatCompletionStreamResponse")
        else:
            choices = chunk.get("choices", [])
            before_last = any(c.get("finish_reason") is None for c in choices)
            self.check(what, chunk, "CreateCompletionResponse", before_last=before_last)

    def check_error(self, what: str, response: httpx.Response, status: int) -> dict[str, Any]:
        assert response.status_code == status, f"{what}: {response.status_code} {response.text}"
        body: dict[str, Any] = response.json()
        self.check(f"{what} ({status})", body, "ErrorResponse")
        return body["error"]  # type: ignore[no-any-return]


def sse_events(raw: str) -> list[Any]:
    """The JSON events of an SSE body, which must end with ``[DONE]``."""
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [orjson.loads(item) for item in data[:-1]]


# -- the schema file itself ----------------------------------------------------------------


def test_the_schemas_name_their_source_and_are_complete() -> None:
    source = SPEC["source"]
    assert source["repo"] == "openai/openai-openapi"
    assert len(source["commit"]) == 40
    assert source["version"]
    schemas = COMPONENTS["schemas"]
    refs = {ref for name in schemas for ref in _refs(schemas[name])}
    assert refs <= {f"#/components/schemas/{name}" for name in schemas}
    assert "nullable" not in json.dumps(schemas)  # rewritten as anyOf [..., null]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if "$ref" in node else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_extraction_keeps_fields_named_like_keywords_and_reads_nullable_as_or_null() -> None:
    document = {
        "components": {
            "schemas": {
                "ListModelsResponse": {"$ref": "#/components/schemas/Thing"},
                "Thing": {
                    "description": "prose, left out",
                    "x-oaiMeta": {"name": "left out"},
                    "properties": {
                        "description": {"type": "string", "nullable": True},
                        "title": {"type": "integer", "example": 3},
                    },
                },
                "Unused": {"type": "string"},
                **{name: {"type": "object"} for name in ROOTS if name != "ListModelsResponse"},
            }
        }
    }
    picked = extract(document)
    assert "Unused" not in picked
    assert picked["Thing"] == {
        "properties": {
            "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "title": {"type": "integer"},
        }
    }


def _reply(**fields: Any) -> Reply:
    values: dict[str, Any] = {"id": "r", "n": 0, "done": True, "status": "ok"}
    return Reply(**{**values, "finish_reason": "stop", "completion_tokens": 3, **fields})


def test_a_missing_required_field_fails_the_check() -> None:
    env = envelope(kind="chat", cls="chat", messages=[], model="laneway-chat")
    body = final_body(env, "hello", _reply(route="laneway-chat"))
    assert problems(body, "CreateChatCompletionResponse") == []
    del body["choices"][0]["message"]["refusal"]
    assert problems(body, "CreateChatCompletionResponse") == [
        "CreateChatCompletionResponse at /choices/0/message: 'refusal' is a required property"
    ]
    error = error_body("no", type_="invalid_request_error", code=None)
    assert problems(error, "ErrorResponse") == []
    del error["error"]["param"]
    assert problems(error, "ErrorResponse") != []


def test_only_completion_chunks_before_the_last_may_carry_a_null_finish_reason() -> None:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "laneway-code",
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
    }
    assert problems(chunk, "CreateCompletionResponse") != []  # why the deviation exists
    assert problems(chunk, "CreateCompletionResponse", CHUNK_COMPONENTS) == []
    del chunk["choices"][0]["logprobs"]  # type: ignore[attr-defined]
    assert problems(chunk, "CreateCompletionResponse", CHUNK_COMPONENTS) != []


# -- the live stack ------------------------------------------------------------------------


@pytest.fixture
async def served(stack: LiveStack) -> tuple[LiveStack, httpx.AsyncClient]:
    ingress = await stack.start_ingress()
    # Decode steps 5 ms apart: a stream of many chunks, each of them checked.
    await stack.start_worker("completion", sim_decode_ms_per_step=5.0)
    await stack.start_worker("chat", sim_decode_ms_per_step=5.0)
    return stack, stack.http(ingress, await stack.api_key("team-a"))


COMPLETION = {"model": "laneway-code", "prompt": "def add(a, b):", "suffix": "\n", "max_tokens": 16}
CHAT = {
    "model": "laneway-chat",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "explain this diff"}]},
    ],
    "max_tokens": 24,
}
USAGE = {"stream_options": {"include_usage": True}}


async def test_every_success_body_and_chunk_conforms(
    served: tuple[LiveStack, httpx.AsyncClient],
) -> None:
    _, http = served
    wire = Wire()
    wire.check("models", (await http.get("/v1/models")).json(), "ListModelsResponse")
    wire.check("model", (await http.get("/v1/models/laneway-code")).json(), "Model")
    for path, body, name in (
        ("/v1/completions", COMPLETION, "CreateCompletionResponse"),
        ("/v1/chat/completions", CHAT, "CreateChatCompletionResponse"),
    ):
        whole = await http.post(path, json=body)
        assert whole.status_code == 200, whole.text
        wire.check(path, whole.json(), name)
        for options in ({}, USAGE):
            streamed = await http.post(path, json={**body, "stream": True, **options})
            assert streamed.status_code == 200, streamed.text
            chunks = sse_events(streamed.text)
            for i, chunk in enumerate(chunks):
                wire.check_chunk(f"{path} stream {options} chunk {i}", chunk)
            ends = [c for c in chunks for choice in c["choices"] if choice.get("finish_reason")]
            assert len(ends) == 1, chunks  # one chunk says why it ended
            with_usage = [c for c in chunks if c.get("usage")]
            if options:  # the last chunk carries the usage and no choices
                assert with_usage == [chunks[-1]]
                assert chunks[-1]["choices"] == []
            else:
                assert with_usage == []
    assert wire.failures == []
    assert set(wire.checked) == {
        "ListModelsResponse",
        "Model",
        "CreateCompletionResponse",  # the whole body, the last chunk and the usage chunk
        "CreateCompletionResponse before the last",
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
    }


async def test_the_official_sdk_reads_the_request_id_of_answers_streams_and_errors(
    stack: LiveStack,
) -> None:
    """The OpenAI SDK reads ``x-request-id`` as ``request_id`` (of a raw response, of a parsed
    one as ``_request_id``, of an ``APIStatusError``): it is the request's id, the one in the
    body and in ``x-laneway-request-id``, the one to cancel or to quote in a report."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    await stack.start_worker("chat", sim_failure_rate=1.0)
    client = openai.AsyncOpenAI(
        base_url=ingress.base_url + "/v1", api_key=await stack.api_key("team-a"), max_retries=0
    )
    stack.track(client)
    raw = await client.completions.with_raw_response.create(
        model="laneway-code", prompt="def f(", max_tokens=4
    )
    completion = raw.parse()
    assert raw.request_id == completion.id == completion._request_id
    assert raw.headers["x-laneway-request-id"] == completion.id
    streamed = await client.completions.with_raw_response.create(
        model="laneway-code", prompt="def g(", max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in streamed.parse()]
    assert streamed.request_id == chunks[0].id
    with pytest.raises(openai.APIStatusError) as failed:
        await client.chat.completions.create(
            model="laneway-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert failed.value.status_code == 502
    assert failed.value.request_id is not None
    assert failed.value.request_id == failed.value.response.headers["x-laneway-request-id"]


async def _set_isolated(stack: LiveStack, team: str) -> None:
    state = orjson.dumps({"level": 3, "rate": 0.3, "since": 0, "cooldown_s": 7})
    await stack.redis.set(RedisKeys(stack.prefix).breaker("laneway-code", team), state)


async def _queued(stack: LiveStack, count: int) -> list[dict[str, Any]]:
    """The first ``count`` envelopes on the completion lane, once the broker holds them."""
    topic = stack.topics.request("completion", "hi")
    found = await stack.read_topic(topic, count=count, within_s=30)
    assert len(found) == count
    return found


async def test_the_official_sdk_does_not_send_a_superseded_keystroke_again(
    stack: LiveStack,
) -> None:
    """The OpenAI SDK sends a 409 again by default (twice: a lock timeout at OpenAI). A
    keystroke its next one superseded came back so, streamed or not, each time reserving
    quota and going through Kafka to be dropped again, during the very storms the shield is
    for. Its answer now says not to (``x-should-retry: false``), and the SDK raises at once."""
    ingress = await stack.start_ingress()
    sent: list[str | None] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.headers.get("x-laneway-seq"))

    http_client = httpx.AsyncClient(event_hooks={"request": [count]})
    client = openai.AsyncOpenAI(  # its default retries
        base_url=ingress.base_url + "/v1",
        api_key=await stack.api_key("ide", size=100),
        http_client=http_client,
    )
    stack.track(client)

    def typed(seq: int, *, stream: bool) -> Any:
        headers = {"X-Laneway-Session": "doc", "X-Laneway-Seq": str(seq)}
        return client.completions.create(
            model="laneway-code",
            prompt="def f(",
            max_tokens=8,
            stream=stream,
            extra_headers=headers,
        )

    # Queued with no worker yet, then superseded by the third.
    first = asyncio.create_task(typed(1, stream=False))
    second = asyncio.create_task(typed(2, stream=True))
    await _queued(stack, 2)
    third = asyncio.create_task(typed(3, stream=False))
    await _queued(stack, 3)
    await stack.start_worker("completion")
    for older in (first, second):
        with pytest.raises(openai.ConflictError) as dropped:
            await older
        assert dropped.value.code == "superseded"
        assert dropped.value.response.headers["x-should-retry"] == "false"
    assert (await third).choices[0].text
    assert sorted(sent, key=str) == ["1", "2", "3"]  # each sent once


async def test_a_stream_whose_worker_goes_silent_ends_with_a_timeout_the_client_is_told(
    stack: LiveStack,
) -> None:
    """A stream whose worker hangs mid-run (SIGSTOP) ends after LANEWAY_REPLY_TIMEOUT_S with
    a timeout event and ``[DONE]``; the ingress counts it as a 504 the client was told, not
    as a client gone (a 499), and tells the worker to stop it (a tombstone)."""
    ingress = await stack.start_ingress(reply_timeout_s=3.0)
    worker = stack.spawn(
        "workers",
        LANEWAY_POOL="completion",
        LANEWAY_ENGINE="sim",
        LANEWAY_SIM_DECODE_MS_PER_STEP="100",
        LANEWAY_LOG_LEVEL="WARNING",
    )
    try:
        http = stack.http(ingress, await stack.api_key("team-a", size=1000))

        async def served() -> bool:
            return (await http.post("/v1/completions", json=COMPLETION)).status_code == 200

        await eventually(served, 60, "the worker to serve")
        cls = "completion"
        told, gone = _count(RESPONSES, cls, "504"), _count(CLIENT_GONE, cls)
        body = {**COMPLETION, "max_tokens": 64, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # the first chunk: it runs
            worker.send_signal(signal.SIGSTOP)
            rest = [line async for line in lines]
            rid = response.headers["x-laneway-request-id"]
        tail = sse_events("\n".join(rest))
        Wire().check("stream gone silent", tail[-1], "ErrorResponse")
        assert tail[-1]["error"]["code"] == "deadline_exceeded"
        assert (_count(RESPONSES, cls, "504"), _count(CLIENT_GONE, cls)) == (told + 1, gone)
        await stack.read_topic(stack.topics.cancel, count=1, where=lambda r: r["id"] == rid)
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        worker.wait(timeout=30)


def _count(counter: Any, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


async def test_every_error_body_conforms(stack: LiveStack) -> None:
    # 100 tokens an hour per member: a team of one is over budget with its first request.
    ingress = await stack.start_ingress(max_prompt_tokens=1000, quota_units_per_member=0.1)
    await _set_isolated(stack, "isolated")  # before its first request: nothing cached
    http = stack.http(ingress, await stack.api_key("team-a", size=1000))
    wire = Wire()

    async def post(body: object, path: str = "/v1/completions", **kw: Any) -> httpx.Response:
        return await http.post(path, json=body, **kw)

    bad = [
        (b"{not json", None),
        (b'{"model": "laneway-code"}', "prompt"),
        (b'{"model": "laneway-code", "prompt": "x", "n": 2}', "n"),
        (b'{"model": "laneway-code", "prompt": "x", "top_k": 5}', "top_k"),
    ]
    for raw, param in bad:
        response = await http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert wire.check_error(f"body {raw!r}", response, 400)["param"] == param
    anonymous = stack.http(ingress)
    wire.check_error("no key", await anonymous.post("/v1/completions", json=COMPLETION), 401)
    wire.check_error("no key, models", await anonymous.get("/v1/models"), 401)
    # The key without its scheme: told what the header must be, not that it is missing.
    schemeless = await anonymous.get("/v1/models", headers={"Authorization": "sk-something"})
    said = wire.check_error("no scheme", schemeless, 401)["message"]
    assert "must be 'Bearer <key>'" in said, said
    assert "sk-something" not in said, said
    wire.check_error("unknown model", await post({**COMPLETION, "model": "gpt-nope"}), 404)
    wire.check_error("unknown path", await http.get("/v1/nothing-here"), 404)
    # An OpenAI API laneway does not serve (the Vercel AI SDK's default provider calls the
    # Responses API): told what it serves, not a bare "Not Found".
    responses = await http.post("/v1/responses", json={"model": "laneway-chat", "input": "hi"})
    said = wire.check_error("the Responses API", responses, 404)["message"]
    assert "/v1/responses is not served here" in said, said
    assert "provider.chat(model)" in said, said
    assert "/v1/chat/completions" in said, said
    wire.check_error("wrong method", await http.get("/v1/completions"), 405)
    # As OpenAI answers a prompt over the context: 400 context_length_exceeded, the limit named.
    too_long = await post({**COMPLETION, "prompt": "x" * 8000})
    error = wire.check_error("prompt too large", too_long, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "maximum context length is 1000 tokens" in error["message"]
    tiny = stack.http(ingress, await stack.api_key("tiny", size=1))
    over = {**COMPLETION, "max_tokens": 128}  # its reservation alone is over the 100 tokens
    wire.check_error("over quota", await tiny.post("/v1/completions", json=over), 429)
    isolated = stack.http(ingress, await stack.api_key("isolated", size=1000))
    wire.check_error("isolated", await isolated.post("/v1/completions", json=COMPLETION), 503)

    # Queued with no worker yet: one cancelled, one past its deadline, one superseded.
    session = {"X-Laneway-Session": "doc", "X-Laneway-Seq": "1"}
    cancelled = asyncio.create_task(post({**COMPLETION, "prompt": "cancel me"}))
    expired = asyncio.create_task(post(COMPLETION, headers={"X-Laneway-Deadline-Ms": "1"}))
    superseded = asyncio.create_task(post(COMPLETION, headers=session))
    await _queued(stack, 3)
    newer = asyncio.create_task(post(COMPLETION, headers={**session, "X-Laneway-Seq": "2"}))
    (victim,) = [e for e in await _queued(stack, 4) if e["prompt"] == "cancel me"]
    assert (await http.delete(f"/v1/requests/{victim['id']}")).status_code == 200
    # Its 1 ms deadline passed while the broker was read back: it expires unstarted.
    await stack.start_worker("completion", sim_decode_ms_per_step=50)
    dropped = wire.check_error("cancelled", await cancelled, 409)
    assert dropped["code"] == "cancelled"
    assert wire.check_error("superseded", await superseded, 409)["code"] == "superseded"
    wire.check_error("expired", await expired, 504)
    assert (await newer).status_code == 200

    # A stream cancelled after its first chunk ends with an error event, then [DONE].
    body = {"model": "laneway-code", "prompt": long_prompt(60), "max_tokens": 128, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break  # the first chunk: it runs
        running = f"/v1/requests/{response.headers['x-laneway-request-id']}"
        wire.check_error("another team's request", await tiny.delete(running), 404)
        assert (await http.delete(running)).status_code == 200
        rest = [line async for line in lines]
    tail = sse_events("\n".join(rest))
    wire.check("stream cancelled", tail[-1], "ErrorResponse")
    # In the words the request would have had unstreamed.
    assert (tail[-1]["error"]["type"], tail[-1]["error"]["code"]) == (dropped["type"], "cancelled")

    # The engine fails: 502.
    await stack.start_worker("chat", sim_failure_rate=1.0)
    wire.check_error("engine failure", await post(CHAT, "/v1/chat/completions"), 502)
    assert wire.failures == []
