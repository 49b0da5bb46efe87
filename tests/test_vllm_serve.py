"""The shield in front of vLLM's own server (``vllm serve``), judged by vLLM's own account.

The other shield tests put laneway in front of ``bench.upstream_server``, a separate process
but one of ours. Here the upstream is vLLM's OpenAI-compatible server itself (its CPU build,
a tiny model with random weights that never ends a request early), and what reached it, what
it aborted and how many tokens it made are read from its request log and its ``/metrics``
(``bench._vllm_serve``), not from laneway. Opt-in: ``make test-vllm``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from bench._vllm_serve import Reading, VllmServe, vllm_serve
from tests.stack import Ingress, LiveStack, eventually, free_port
from workers.pool import PoolWorker
from workers.select import vllm_installed
from workers.upstream import OpenAICompatibleEngine

MAX_NUM_SEQS = 2
# Long enough to hold vLLM for a minute (a few ms a token): nothing ends on its own while a
# test looks; every such request is cancelled by the test.
LONG = 16_000

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_installed(), reason="needs vLLM's CPU build: make test-vllm"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def served() -> Iterator[VllmServe]:
    with vllm_serve(free_port(), max_num_seqs=MAX_NUM_SEQS, max_model_len=LONG + 384) as server:
        yield server


async def _laneway(
    stack: LiveStack, served: VllmServe, **worker: Any
) -> tuple[Ingress, PoolWorker, httpx.AsyncClient]:
    room: dict[str, Any] = {"completion_max_tokens": LONG + 100}
    ingress = await stack.start_ingress(completion_deadline_ms=60_000, **room)
    pool = await stack.start_worker(
        "completion",
        engine="openai",
        upstream_url=served.url,
        upstream_model="up",
        **room,
        **worker,
    )
    return ingress, pool, stack.http(ingress, await stack.api_key(size=100))


def _completion(prompt: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "laneway-code", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def _load(served: VllmServe) -> tuple[int, int]:
    async with httpx.AsyncClient(timeout=5) as client:
        return await served.load(client)


async def _until_vllm_runs(served: VllmServe, count: int, waiting: int = 0) -> None:
    async def there() -> bool:
        running, queued = await _load(served)
        return running >= count and queued >= waiting

    await eventually(there, 30, f"{count} requests running on vLLM, {waiting} waiting")


async def _generation_stopped(served: VllmServe) -> Reading:
    """vLLM's reading once its token count holds still for half a second."""

    async def still() -> Reading | None:
        first = served.reading()
        await asyncio.sleep(0.5)
        second = served.reading()
        return second if second.generated_tokens == first.generated_tokens else None

    stopped: Reading = await eventually(still, 30, "vLLM to stop generating")
    return stopped


async def test_superseded_and_cancelled_keystrokes_never_reach_vllm_serve(
    stack: LiveStack, served: VllmServe
) -> None:
    """With vLLM's one slot laneway may use taken, a keystroke superseded while it waits and
    one whose client left are dropped in laneway's queue: vLLM never sees either. Cancelling
    the request on vLLM aborts it there at once, and the last keystroke runs."""
    _, worker, http = await _laneway(stack, served, upstream_slots=1)
    async with http.stream(
        "POST", "/v1/completions", json=_completion("hold", LONG, stream=True)
    ) as occupant:
        occupant_id = occupant.headers["x-laneway-request-id"]
        lines = occupant.aiter_lines()  # held: a dropped line iterator closes the stream
        async for line in lines:
            if line.startswith("data: {"):
                break
        await _until_vllm_runs(served, 1)
        before = served.reading()

        gone = asyncio.create_task(http.post("/v1/completions", json=_completion("gone", 8)))
        await eventually(lambda: len(worker.queue) == 1, 20, "a request waiting in laneway")
        gone.cancel()  # its client leaves: a tombstone
        await eventually(lambda: len(worker.queue) == 0, 20, "the tombstone to drop it")

        session = {"X-Laneway-Session": "src/app.py"}
        first = asyncio.create_task(
            http.post(
                "/v1/completions",
                json=_completion("def handler(request):", 8),
                headers={**session, "X-Laneway-Seq": "1"},
            )
        )
        await eventually(lambda: len(worker.queue) == 1, 20, "keystroke 1 waiting in laneway")
        second = asyncio.create_task(
            http.post(
                "/v1/completions",
                json=_completion("def handler(request): ", 8),
                headers={**session, "X-Laneway-Seq": "2"},
            )
        )
        assert (await first).status_code == 409  # superseded before it started
        assert len(worker.queue) == 1

        cancelled = served.reading()
        assert (await http.delete(f"/v1/requests/{occupant_id}")).status_code == 200
        assert (await second).status_code == 200
        rest = [line async for line in lines if line.startswith("data: ")]
    assert '"cancelled"' in rest[-2]
    stopped = await _generation_stopped(served)

    did = stopped - before
    # Reached vLLM after the occupant: the last keystroke alone. Aborted: the occupant alone.
    assert (did.added, did.aborted) == (1, 1)
    # From the cancel on, vLLM made the last keystroke's 8 tokens and the occupant's last
    # few (the cancel crosses Kafka to the worker, which closes the connection): not the
    # thousands it had left.
    assert 8 <= (stopped - cancelled).generated_tokens < 8 + 100


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])
async def test_a_client_that_leaves_stops_its_request_on_vllm_serve(
    stack: LiveStack, served: VllmServe, stream: bool
) -> None:
    _, _, http = await _laneway(stack, served, upstream_slots=MAX_NUM_SEQS)
    before = served.reading()
    body = _completion("def leave(now):", LONG, stream=stream)

    async def ask() -> None:
        if not stream:
            await http.post("/v1/completions", json=body)
            return
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass

    client = asyncio.create_task(ask())
    await _until_vllm_runs(served, 1)
    client.cancel()  # the client closes its connection
    await asyncio.gather(client, return_exceptions=True)
    stopped = await _generation_stopped(served)
    did = stopped - before
    assert (did.added, did.aborted) == (1, 1)
    assert 0 < did.generated_tokens < LONG / 10


async def test_the_worker_learns_vllm_serves_capacity_from_its_metrics(
    stack: LiveStack, served: VllmServe
) -> None:
    """No ``LANEWAY_UPSTREAM_SLOTS``: the worker starts at 4 and reads vLLM's /metrics as vLLM
    writes them (its queue, ``vllm:num_requests_waiting``, and its KV-cache usage). Two of
    four waiting there bring the worker's limit to vLLM's ``--max-num-seqs``, and a fifth
    request waits in laneway's queue, where the shield still reaches it."""
    _, worker, http = await _laneway(stack, served, upstream_metrics_url="auto")
    engine = worker.engine
    assert isinstance(engine, OpenAICompatibleEngine)
    assert engine.learned.limit == 4
    clients = [
        asyncio.create_task(http.post("/v1/completions", json=_completion(f"fill-{i}", LONG)))
        for i in range(4)
    ]
    await _until_vllm_runs(served, MAX_NUM_SEQS, waiting=2)
    seen = await eventually(
        lambda: (stats := engine.stats()).waiting == 2 and stats, 20, "vLLM's queue read"
    )
    assert 0 < seen.kv_cache_usage < 1
    await eventually(
        lambda: engine.learned.limit == MAX_NUM_SEQS, 20, "the limit learned from vLLM's queue"
    )
    later = asyncio.create_task(http.post("/v1/completions", json=_completion("later", LONG)))
    await eventually(lambda: len(worker.queue) == 1, 20, "the fifth request waiting in laneway")
    for client in [*clients, later]:
        client.cancel()
    await asyncio.gather(*clients, later, return_exceptions=True)
    await _generation_stopped(served)
    assert await _load(served) == (0, 0)


async def test_typing_what_vllm_suggests_is_served_from_its_running_generation(
    stack: LiveStack, served: VllmServe
) -> None:
    """Type-through in front of vLLM serve: the user types the first characters vLLM's
    suggestion streamed; the new keystroke gets the rest of that generation, and vLLM, by its
    own count, ran one request and made one suggestion's tokens for both keystrokes."""
    _, _, http = await _laneway(stack, served, upstream_slots=MAX_NUM_SEQS)
    before = served.reading()
    session = {"X-Laneway-Session": "src/main.py"}
    body = _completion("def main():", 400, stream=True)
    request = http.build_request(
        "POST", "/v1/completions", json=body, headers={**session, "X-Laneway-Seq": "1"}
    )
    first = await http.send(request, stream=True)
    first_id = first.headers["x-laneway-request-id"]
    lines = first.aiter_lines()
    shown = ""
    while len(shown) < 3:
        line = await anext(lines)
        if line.startswith("data: {"):
            shown += orjson.loads(line[6:])["choices"][0]["text"]
    typed = shown[:3]
    second = await http.post(
        "/v1/completions",
        json=_completion("def main():" + typed, 400),
        headers={**session, "X-Laneway-Seq": "2"},
    )
    await first.aclose()
    assert second.status_code == 200, second.text
    rest = second.json()["choices"][0]["text"]
    assert (typed + rest).startswith(shown)
    usage = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda u: u["id"] == second.json()["id"]
    )
    assert (usage[0]["status"], usage[0]["reused_from"]) == ("ok", first_id)
    did = (await _generation_stopped(served)) - before
    assert did.added == 1
    assert did.generated_tokens == 400


async def test_a_chat_that_sets_no_length_gets_the_room_vllm_serves_context_leaves(
    stack: LiveStack, served: VllmServe
) -> None:
    """A chat with no ``max_tokens`` is sent laneway's cap; vLLM refuses a prompt within the
    cap of its context in its own words, and the chat is sent again with the room those
    words name, as vLLM gives a chat that sets no length. Before: a 400 for a prompt vLLM
    takes from a client that sends it directly."""
    room = 24
    ingress = await stack.start_ingress(chat_deadline_ms=60_000)
    await stack.start_worker("chat", engine="openai", upstream_url=served.url, upstream_model="up")
    http = stack.http(ingress, await stack.api_key(size=100))
    async with httpx.AsyncClient(base_url=served.url.removesuffix("/v1"), timeout=30) as vllm:

        async def tokens(text: str) -> int:
            body = {"model": "up", "messages": [{"role": "user", "content": text}]}
            response = await vllm.post("/tokenize", json=body)
            response.raise_for_status()
            return int(response.json()["count"])

        # A prompt that leaves `room` of the context by vLLM's own count (its template too).
        text, context = "", LONG + 384
        while (count := await tokens(text)) < context - room:
            text += "def f(x):\n    return x\n" * max(1, (context - room - count) // 40)
        while await tokens(text) > context - room:
            text = text[:-1]
        left = context - await tokens(text)
        direct = await vllm.post(
            "/v1/chat/completions",
            json={"model": "up", "messages": [{"role": "user", "content": text}]},
        )
        assert direct.status_code == 200, direct.text  # vLLM takes it from a client itself
    response = await http.post(
        "/v1/chat/completions",
        json={"model": "laneway-chat", "messages": [{"role": "user", "content": text}]},
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == left


# An agent's function tools (as Cline or Continue send them), for the tool-call tests.
READ = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "enum": ["a.py", "b.py"]}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
}
EDIT = {
    "type": "function",
    "function": {
        "name": "edit_file",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASKED = [{"role": "user", "content": "fix the bug in a.py"}]


async def _agent(stack: LiveStack, served: VllmServe) -> openai.AsyncOpenAI:
    """The official SDK as an agent's client, through laneway's chat pool to vLLM serve."""
    ingress = await stack.start_ingress(chat_deadline_ms=60_000)
    await stack.start_worker("chat", engine="openai", upstream_url=served.url, upstream_model="up")
    client = openai.AsyncOpenAI(
        base_url=ingress.base_url + "/v1",
        api_key=await stack.api_key(size=100),
        max_retries=0,
        timeout=120,
    )
    stack.track(client)
    return client


async def _direct(served: VllmServe, body: dict[str, Any]) -> httpx.Response:
    """What vLLM serve itself answers ``body`` (model ``up``), not through laneway."""
    async with httpx.AsyncClient(timeout=120) as vllm:
        return await vllm.post(f"{served.url}/chat/completions", json={**body, "model": "up"})


async def _ask(client: openai.AsyncOpenAI, body: dict[str, Any], *, stream: bool) -> None:
    """``body`` asked of laneway, a stream read to its end."""
    if not stream:
        await client.chat.completions.create(model="laneway-chat", stream=False, **body)
        return
    async for _ in await client.chat.completions.create(model="laneway-chat", stream=True, **body):
        pass


def _fold(calls: dict[int, tuple[str, str]], index: int, name: str, arguments: str) -> None:
    """A stream's part of a call folded into ``calls`` by its index, as the SDK folds them."""
    had = calls.get(index, ("", ""))
    calls[index] = (had[0] + name, had[1] + arguments)


async def _vllm_calls(served: VllmServe, body: dict[str, Any]) -> tuple[list[Any], str | None]:
    """vLLM serve's own streamed answer to ``body``: its calls (name, arguments) and its
    finish_reason; fails with its status and body when it refuses."""
    calls: dict[int, tuple[str, str]] = {}
    finish = None
    direct = {**body, "model": "up", "stream": True}
    async with (
        httpx.AsyncClient(timeout=120) as vllm,
        vllm.stream("POST", f"{served.url}/chat/completions", json=direct) as response,
    ):
        await response.aread()
        assert response.status_code == 200, (response.status_code, response.text)
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                for part in choice["delta"].get("tool_calls") or ():
                    function = part.get("function") or {}
                    name, arguments = function.get("name") or "", function.get("arguments") or ""
                    _fold(calls, part["index"], name, arguments)
                finish = choice.get("finish_reason") or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def served_with_tools() -> Iterator[VllmServe]:
    """vLLM serve with a tool parser. The tiny model's end-of-text token lies outside its
    vocabulary, which vLLM's default structured-output backend (xgrammar) refuses with a
    500; guidance takes it."""
    options = (
        "--enable-auto-tool-choice",
        "--tool-call-parser=pythonic",
        "--structured-outputs-config.backend=guidance",
    )
    with vllm_serve(free_port(), max_num_seqs=MAX_NUM_SEQS, options=options) as server:
        yield server


CHOICES = pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "read_file"}}],
    ids=["required", "named"],
)
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])


@STREAMS
@CHOICES
async def test_required_and_named_tool_choices_come_back_as_the_calls_vllm_serve_made(
    stack: LiveStack, served_with_tools: VllmServe, choice: Any, stream: bool
) -> None:
    """vLLM serve with a tool parser makes ``required`` and a named function's calls by
    structured output: the agent gets the calls vLLM made, of its tools, byte for byte, with
    arguments that parse, and vLLM's finish_reason. A seed makes vLLM's own answer and the
    one through laneway the same generation."""
    served = served_with_tools
    body: dict[str, Any] = {
        "messages": ASKED,
        "tools": [READ, EDIT],
        "tool_choice": choice,
        "max_tokens": 200,
        "seed": 11,
    }
    # vLLM's own answer first: the claim holds only if vLLM serves it at all.
    made, said = await _vllm_calls(served, body)
    client = await _agent(stack, served)
    named: list[tuple[str, str]]
    if not stream:
        answer = await client.chat.completions.create(model="laneway-chat", stream=False, **body)
        calls = answer.choices[0].message.tool_calls or []
        finish = answer.choices[0].finish_reason
        named = [(c.function.name, c.function.arguments) for c in calls]
    else:
        folded: dict[int, tuple[str, str]] = {}
        finish = None
        async for chunk in await client.chat.completions.create(
            model="laneway-chat", stream=True, **body
        ):
            for each in chunk.choices:
                for part in each.delta.tool_calls or ():
                    function = part.function
                    name = (function.name if function else None) or ""
                    arguments = (function.arguments if function else None) or ""
                    _fold(folded, part.index, name, arguments)
                finish = each.finish_reason or finish
        named = [folded[i] for i in sorted(folded)]
    assert named == made
    assert named, "vLLM made no call"
    for name, arguments in named:
        assert name in {"read_file", "edit_file"}
        if isinstance(choice, dict):
            assert name == "read_file"
        assert isinstance(json.loads(arguments), dict)
    assert finish == said


@STREAMS
@pytest.mark.parametrize(
    "choice",
    ["auto", "required", {"type": "function", "function": {"name": "read_file"}}],
    ids=["auto", "required", "named"],
)
async def test_tool_choices_on_vllm_serve_without_a_parser_are_unsupported(
    stack: LiveStack, served: VllmServe, choice: Any, stream: bool
) -> None:
    """vLLM serve started without a tool parser refuses every tool choice but ``none``
    (``auto`` is the default with tools): the agent gets that 400 naming ``tool_choice``,
    and the usage event says ``unsupported`` (neither charged nor counted by a breaker: a
    team is not shut out for what the server lacks)."""
    body: dict[str, Any] = {
        "messages": ASKED,
        "tools": [READ, EDIT],
        "tool_choice": choice,
        "max_tokens": 8,
    }
    direct = await _direct(served, body)
    assert direct.status_code == 400, direct.text
    client = await _agent(stack, served)
    with pytest.raises(openai.BadRequestError) as refused:
        await _ask(client, body, stream=stream)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "tool_choice", error
    assert "--tool-call-parser" in error["message"]
    request_id = refused.value.response.headers["x-laneway-request-id"]
    usage = await stack.usage_of(request_id)
    assert usage[request_id]["status"] == "unsupported"


@pytest.mark.parametrize("tools", [True, False], ids=["tools-none-chosen", "no-tools"])
async def test_an_agents_history_of_calls_and_tool_answers_is_taken_by_vllm_serve(
    stack: LiveStack, served: VllmServe, tools: bool
) -> None:
    """The turn after a call: the assistant's tool_calls (content null) and each tool's
    answer by its tool_call_id reach vLLM serve, which takes them."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    }
    history = [
        *ASKED,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "def f(): return 1"},
    ]
    body: dict[str, Any] = {"messages": history, "max_tokens": 4}
    if tools:
        body |= {"tools": [READ], "tool_choice": "none"}
    client = await _agent(stack, served)
    answer = await client.chat.completions.create(model="laneway-chat", **body)
    assert answer.choices[0].finish_reason == "length"
    # vLLM read the history whole: its prompt is the one it makes of these messages itself.
    async with httpx.AsyncClient(timeout=30) as vllm:
        tokenized = await vllm.post(
            served.url.removesuffix("/v1") + "/tokenize",
            json={"model": "up", "messages": history},
        )
    assert tokenized.status_code == 200, tokenized.text
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == tokenized.json()["count"]
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None
    usage = await stack.usage_of(answer.id)
    assert usage[answer.id]["status"] == "ok"
