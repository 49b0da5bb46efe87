"""The shield in front of vLLM's own server (``vllm serve``), judged by vLLM's own account.

The other shield tests put laneway in front of ``bench.upstream_server``, a separate process
but one of ours. Here the upstream is vLLM's OpenAI-compatible server itself (its CPU build,
a tiny model with random weights that never ends a request early), and what reached it, what
it aborted and how many tokens it made are read from its request log and its ``/metrics``
(``bench._vllm_serve``), not from laneway. Opt-in: ``make test-vllm``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
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
