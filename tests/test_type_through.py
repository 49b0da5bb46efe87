"""Type-through: a keystroke that types the running suggestion is served from it, judged by a
separate upstream process's own log of what it ran."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.stack import LiveStack, eventually
from tests.upstream_process import UpstreamProcess
from workers.pool import PoolWorker

pytestmark = pytest.mark.slow

SESSION = "src/app.py"
# What bench.upstream_server answers: these words in turn, one a token.
WORDS = ["alpha ", "beta ", "gamma ", "delta ", "omega ", "sigma ", "kappa ", "theta "]


def _suggestion(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(tokens))


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[UpstreamProcess]:
    process = UpstreamProcess(tmp_path / "upstream.jsonl", slots=4, token_ms=60)
    await process.ready()
    yield process
    process.stop()


async def _worker(stack: LiveStack, upstream: UpstreamProcess, **options: Any) -> PoolWorker:
    return await stack.start_worker(
        "completion",
        engine="openai",
        upstream_url=upstream.url,
        upstream_model="up",
        upstream_metrics_url="",
        **options,
    )


def _keystroke(
    prompt: str, seq: int, *, stream: bool = True, max_tokens: int = 12
) -> dict[str, Any]:
    return {
        "json": {
            "model": "laneway-code",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": stream,
        },
        "headers": {"X-Laneway-Session": SESSION, "X-Laneway-Seq": str(seq)},
    }


class _Open:
    """Keystroke 1, streaming: read until ``words`` words of its suggestion came, then left
    open (its line iterator held: dropping it would close the connection) until ``aclose``."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()
        self.id = response.headers["x-laneway-request-id"]
        self.text = ""

    async def read_words(self, words: int) -> None:
        while self.text.count(" ") < words:
            line = await anext(self.lines)
            if line.startswith("data: {"):
                self.text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]

    async def aclose(self) -> None:
        await self.response.aclose()


async def _first_words(
    http: httpx.AsyncClient, prompt: str, words: int, max_tokens: int = 12
) -> tuple[_Open, str]:
    request = http.build_request(
        "POST", "/v1/completions", **_keystroke(prompt, 1, max_tokens=max_tokens)
    )
    response = await http.send(request, stream=True)
    assert response.status_code == 200
    opened = _Open(response)
    await opened.read_words(words)
    return opened, opened.id


def _text(response: httpx.Response) -> str:
    return str(response.json()["choices"][0]["text"])


async def test_typing_the_suggestion_gets_the_rest_without_a_new_engine_request(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    first, first_id = await _first_words(http, "def main():", 2)
    # The user types the suggestion's first word; the IDE sends the new keystroke and drops
    # the old request.
    typed = http.post("/v1/completions", **_keystroke("def main():" + WORDS[0], 2, stream=False))
    second = await typed
    await first.aclose()
    assert second.status_code == 200
    assert _text(second) == _suggestion(12)[len(WORDS[0]) :]
    await eventually(lambda: upstream.entry("def main():") is not None, 10, "the generation's end")
    prompts = [e["prompt"] for e in upstream.entries()]
    assert prompts == ["def main():"]  # one engine request for both keystrokes
    usage = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda u: u["id"] == second.json()["id"]
    )
    assert usage[0]["status"] == "ok"
    assert usage[0]["reused_from"] == first_id
    assert usage[0]["engine_ms"] == 0
    assert usage[0]["completion_tokens"] == 11


async def test_type_through_with_the_official_sdk_as_the_client(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """An unmodified OpenAI SDK on both keystrokes (the session headers as ``extra_headers``,
    as an IDE plugin built on it sends them): the second gets the rest of the first's
    suggestion from one upstream request, and the first, still reading, is told it was
    superseded by the SDK's own error rather than handed a cut text as a whole answer."""
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    sdk = openai.AsyncOpenAI(
        base_url=ingress.base_url + "/v1", api_key=await stack.api_key(), max_retries=0
    )
    stack._clients.append(sdk)  # closed with the stack

    def keystroke(seq: int) -> dict[str, str]:
        return {"X-Laneway-Session": SESSION, "X-Laneway-Seq": str(seq)}

    first = await sdk.completions.create(
        model="laneway-code",
        prompt="def main():",
        max_tokens=12,
        stream=True,
        extra_headers=keystroke(1),
    )
    chunks = aiter(first)
    shown = ""
    while shown.count(" ") < 2:
        shown += (await anext(chunks)).choices[0].text
    second = await sdk.completions.create(
        model="laneway-code",
        prompt="def main():" + WORDS[0],
        max_tokens=12,
        extra_headers=keystroke(2),
    )
    assert second.choices[0].text == _suggestion(12)[len(WORDS[0]) :]
    rest: list[str] = []

    async def read_on() -> None:
        async for chunk in chunks:
            rest.append(chunk.choices[0].text)

    with pytest.raises(openai.APIError, match="superseded"):
        await read_on()
    assert _suggestion(12).startswith(shown + "".join(rest))
    await eventually(lambda: upstream.entry("def main():") is not None, 10, "the generation's end")
    assert [e["prompt"] for e in upstream.entries()] == ["def main():"]
    usage = await stack.usage_of(second.id)
    assert usage[second.id]["reused_from"] == first.response.headers["x-laneway-request-id"]


async def test_the_keystroke_typed_through_is_told_it_was_superseded_and_charged_its_part(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """The older keystroke's client stays (the official SDK does not cancel it): its stream
    ends as any superseded one does, with an error event saying so, not with the text cut
    where the newer keystroke took over passed off as a whole answer. It is charged the
    tokens it was sent; the tokens after are the newer keystroke's (they were charged to
    both)."""
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    first, first_id = await _first_words(http, "def main():", 2)
    second = await http.post(
        "/v1/completions", **_keystroke("def main():" + WORDS[0], 2, stream=False)
    )
    assert second.status_code == 200
    rest = [line async for line in first.lines]  # read to its end
    events = [line[6:] for line in rest if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = httpx.Response(200, content=events[-2]).json()
    assert last["error"]["code"] == "superseded", last
    streamed = first.text + "".join(
        httpx.Response(200, content=e).json()["choices"][0]["text"]
        for e in events[:-2]
        if '"choices"' in e
    )
    assert _suggestion(12).startswith(streamed)
    assert len(streamed) < len(_suggestion(12))  # cut where the second took over
    ids = {first_id, second.json()["id"]}
    usage = await stack.usage_of(*ids)
    assert usage[first_id]["status"] == "superseded"
    # Each is charged what it was sent (a token both were sent, both): the first its own
    # words, not the whole generation of 12 that the second is charged 11 of.
    assert usage[first_id]["completion_tokens"] == streamed.count(" ") < 12
    assert usage[second.json()["id"]]["completion_tokens"] == 11


async def test_a_diverging_keystroke_supersedes_as_before(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    # Long enough (6 s) that the next keystroke comes while it runs, however slow Kafka is.
    first, _ = await _first_words(http, "def main():", 1, max_tokens=100)
    second = await http.post("/v1/completions", **_keystroke("def main():zz", 2, stream=False))
    await first.aclose()
    assert second.status_code == 200
    assert _text(second) == _suggestion(12)
    await eventually(lambda: len(upstream.entries()) == 2, 10, "both requests in the log")
    outcomes = {e["prompt"]: e["outcome"] for e in upstream.entries()}
    assert outcomes == {"def main():": "gone_running", "def main():zz": "done"}


async def test_a_keystroke_never_follows_a_generation_whose_abort_is_under_way(
    stack: LiveStack,
) -> None:
    """Found by the storm drill on a loaded machine: a generation whose client left is
    aborted (no keystroke followed within the hold), and the abort lands at the engine's next
    step. A keystroke typing through it in between used to follow it and got the text cut
    short, an error, instead of a suggestion. It runs on its own now."""
    ingress = await stack.start_ingress()
    # Steps this slow (simulated GPU) keep the abort under way while the keystroke comes.
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=1000.0, reuse_hold_ms=0)
    http = stack.http(ingress, await stack.api_key())
    first, first_id = await _first_words(http, "def main():", 1)
    await first.aclose()  # its client leaves: a tombstone, and with no hold, the abort
    shield = worker.executor.shield
    await eventually(lambda: shield.stale_reason(first_id) is not None, 10, "the tombstone")
    typed = {**_keystroke("def main():" + first.text, 2, stream=False)}
    typed["json"] = {**typed["json"], "max_tokens": 2}
    second = await http.post("/v1/completions", **typed)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["finish_reason"] == "length"
    usage = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda u: u["id"] == second.json()["id"]
    )
    assert (usage[0]["status"], usage[0]["reused_from"]) == ("ok", None)
    assert usage[0]["completion_tokens"] == 2


def _hold_long(worker: PoolWorker) -> None:
    """A wait for the next keystroke that no test outlasts (the setting's bound is 1 s):
    a generation that waits does so until that keystroke comes, however slow Kafka is."""
    worker.executor.reuse_hold_s = 600.0


async def test_a_shown_suggestion_whose_client_left_waits_for_the_keystroke_typing_it(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """The IDE drops the old request before the new keystroke reaches the worker (its
    tombstone comes through Redis, the keystroke through Kafka): the suggestion its client
    was shown waits for it instead of being aborted."""
    ingress = await stack.start_ingress()
    worker = await _worker(stack, upstream)
    _hold_long(worker)
    http = stack.http(ingress, await stack.api_key())
    first, first_id = await _first_words(http, "def main():", 2)
    await first.aclose()
    shield = worker.executor.shield
    await eventually(lambda: shield.stale_reason(first_id) is not None, 10, "the tombstone")
    typed = _keystroke("def main():" + WORDS[0], 2, stream=False)
    second = await http.post("/v1/completions", **typed)
    assert second.status_code == 200
    assert _text(second) == _suggestion(12)[len(WORDS[0]) :]
    await eventually(lambda: upstream.entry("def main():") is not None, 10, "the generation's end")
    assert [e["prompt"] for e in upstream.entries()] == ["def main():"]


def _made_text(worker: PoolWorker) -> bool:
    """Whether a generation running on the worker has made text."""
    generations = [worker.executor.reuse.of_owner(rid) for rid in worker.runs.running]
    return any(generation is not None and generation.text for generation in generations)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed-no-text-yet", "not-streamed"])
async def test_a_gone_keystroke_whose_suggestion_was_never_shown_stops_at_once(
    stack: LiveStack, upstream: UpstreamProcess, stream: bool
) -> None:
    """Only a suggestion its client was shown waits for the next keystroke: nobody types
    what they never saw. One streamed with no text yet (its upstream in prefill: held here
    before its first token) or one not streamed (shown only once whole) is aborted when its
    client leaves. Waiting for every gone keystroke let the upstream start work nobody
    wanted (issue 22's late starts)."""
    # A start deadline past the test: the upstream's hold is not ended by it.
    ingress = await stack.start_ingress(completion_deadline_ms=60_000)
    worker = await _worker(stack, upstream)
    _hold_long(worker)
    http = stack.http(ingress, await stack.api_key())
    if stream:
        await upstream.hold("def main():")
    # 100 tokens (6 s): its natural end comes long after its client left, however slow.
    body = _keystroke("def main():", 1, stream=stream, max_tokens=100)
    gone = asyncio.create_task(http.post("/v1/completions", **body))
    await upstream.until(lambda running, _: running == 1, "the keystroke to run upstream")
    if not stream:
        await eventually(lambda: _made_text(worker), 10, "its first words")
    gone.cancel()  # the client leaves: a tombstone
    await upstream.until(lambda running, _: running == 0, "its abort, with no wait")
    await eventually(lambda: upstream.entry("def main():") is not None, 10, "its log entry")
    entry = upstream.entry("def main():")
    assert entry is not None
    assert (entry["outcome"], entry["tokens"] < 100) == ("gone_running", True)


async def test_another_team_never_reuses_a_generation(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    mine = stack.http(ingress, await stack.api_key("team-a"))
    theirs = stack.http(ingress, await stack.api_key("team-b"))
    first, _ = await _first_words(mine, "def main():", 2)
    other = await theirs.post(
        "/v1/completions", **_keystroke("def main():" + WORDS[0], 2, stream=False)
    )
    assert other.status_code == 200
    assert _text(other) == _suggestion(12)  # its own answer, from its own engine request
    await first.aclose()
    await eventually(lambda: len(upstream.entries()) == 2, 10, "both requests in the log")
    assert sorted(e["prompt"] for e in upstream.entries()) == [
        "def main():",
        "def main():" + WORDS[0],
    ]


async def test_a_finished_suggestion_stays_reusable_and_a_restart_forgets_it(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    worker = await _worker(stack, upstream, worker_id=f"{stack.prefix}-tt")
    http = stack.http(ingress, await stack.api_key())
    whole = await http.post("/v1/completions", **_keystroke("class A:", 1, stream=False))
    assert _text(whole) == _suggestion(12)
    typed = "class A:" + WORDS[0] + WORDS[1]
    recent = await http.post("/v1/completions", **_keystroke(typed, 2, stream=False))
    assert _text(recent) == _suggestion(12)[len(WORDS[0] + WORDS[1]) :]
    assert [e["prompt"] for e in upstream.entries()] == ["class A:"]

    await worker.stop()
    stack.workers.remove(worker)
    await _worker(stack, upstream, worker_id=f"{stack.prefix}-tt")
    typed += WORDS[2]
    after = await http.post("/v1/completions", **_keystroke(typed, 3, stream=False))
    # Nothing to reuse after the restart: it ran, and its answer is its own.
    assert _text(after) == _suggestion(12)
    await eventually(lambda: len(upstream.entries()) == 2, 10, "the second request in the log")


async def test_identical_requests_in_flight_share_one_generation(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    # The engine's count of the prompt comes in its last message, a moment after the last
    # token (as vLLM's usage does): the one that followed waits for it to be billed alike.
    upstream = await upstreams(slots=4, token_ms=60, end_ms=300)
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    body = {"model": "laneway-code", "prompt": "import os", "max_tokens": 12}
    both = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(2)))
    assert [r.status_code for r in both] == [200, 200]
    assert [_text(r) for r in both] == [_suggestion(12)] * 2
    await eventually(lambda: upstream.entry("import os") is not None, 10, "the log entry")
    assert [e["prompt"] for e in upstream.entries()] == ["import os"]
    # The same prompt is billed the same whether it ran or followed: the engine's count
    # (this upstream's is 2), not the ingress's estimate (3) for the one that followed.
    usage = await stack.usage_of(*(r.json()["id"] for r in both))
    assert sorted(u["prompt_tokens"] for u in usage.values()) == [2, 2]


async def test_a_follower_whose_generation_never_started_keeps_its_deadline(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """Two identical requests share one generation; the upstream holds it before its first
    byte. At their start deadline the one that runs is answered 504; the one that followed
    it is queued to run on its own, and must still be answered 504 by its deadline, not
    sent upstream with none to wait for as long as the upstream holds it."""
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    await upstream.hold("import sys")
    body = {"model": "laneway-code", "prompt": "import sys", "max_tokens": 4}
    deadline = {"X-Laneway-Deadline-Ms": "2000"}

    async def one(after_s: float) -> int:
        await asyncio.sleep(after_s)
        answer = await http.post("/v1/completions", json=body, headers=deadline)
        return answer.status_code

    try:
        # Held for good: only the deadlines can answer them before the bound.
        answers = await asyncio.wait_for(asyncio.gather(one(0), one(0.3)), 20)
    finally:
        await upstream.release("import sys")
    assert answers == [504, 504]


async def test_a_follower_whose_budget_ends_where_its_generation_stopped_says_stop(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """The generation stopped at "gamma" (its third token, which completes the stop string,
    sends no text). A keystroke typing its first word with a budget of two tokens ends on
    that same token: its own run would have said ``stop`` (stops come before the length),
    so it must not be told ``length``."""
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())

    async def ask(seq: int, prompt: str, max_tokens: int) -> tuple[str, str]:
        body = _keystroke(prompt, seq, stream=False, max_tokens=max_tokens)
        body["json"]["stop"] = ["gamma"]
        answer = (await http.post("/v1/completions", **body)).json()["choices"][0]
        return answer["text"], answer["finish_reason"]

    assert await ask(1, "def stop():", 4) == ("alpha beta ", "stop")
    assert await ask(2, "def stop():alpha ", 2) == ("beta ", "stop")
    assert [e["prompt"] for e in upstream.entries()] == ["def stop():"]  # it followed


@pytest.mark.parametrize(
    ("head", "fields"),
    [
        # A seed asks for the same answer whenever the request is sent; a continuation of the
        # previous prompt's sample is not it (sent again with nothing to follow, it differs).
        ("def seeded():", {"seed": 7, "temperature": 0.8}),
        # Penalties weigh what a run wrote, the typed text included, and not a prompt: the
        # request's own run would write something else, even at temperature 0.
        ("def weighed():", {"presence_penalty": 0.5, "temperature": 0}),
    ],
)
async def test_a_request_whose_own_run_would_differ_never_types_through(
    stack: LiveStack, upstream: UpstreamProcess, head: str, fields: dict[str, Any]
) -> None:
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    for seq, prompt in enumerate((head, head + WORDS[0]), start=1):
        body = _keystroke(prompt, seq, stream=False)
        body["json"] |= fields
        assert (await http.post("/v1/completions", **body)).status_code == 200
    await eventually(lambda: len(upstream.entries()) == 2, 10, "both requests in the log")
    assert [e["prompt"] for e in upstream.entries()] == [head, head + WORDS[0]]


async def test_a_team_that_turned_type_through_off_gets_a_request_each(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key("strict", type_through=False))
    whole = await http.post("/v1/completions", **_keystroke("class B:", 1, stream=False))
    typed = "class B:" + WORDS[0]
    again = await http.post("/v1/completions", **_keystroke(typed, 2, stream=False))
    assert (_text(whole), _text(again)) == (_suggestion(12), _suggestion(12))
    await eventually(lambda: len(upstream.entries()) == 2, 10, "both requests in the log")


async def test_accepting_the_whole_suggestion_gets_a_fresh_one(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """The user presses Tab: the next keystroke's prompt ends with the whole suggestion, which
    ended at its max_tokens. Nothing of it is left to give: served from it, the keystroke got
    an empty answer reported ok. It runs on its own."""
    ingress = await stack.start_ingress()
    await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    whole = await http.post("/v1/completions", **_keystroke("class C:", 1, stream=False))
    assert _text(whole) == _suggestion(12)
    accepted = await http.post(
        "/v1/completions", **_keystroke("class C:" + _suggestion(12), 2, stream=False)
    )
    assert accepted.status_code == 200
    assert _text(accepted) == _suggestion(12)  # the upstream's words again, its own
    await eventually(lambda: len(upstream.entries()) == 2, 10, "both requests in the log")
    usage = await stack.read_topic(
        stack.topics.usage, count=1, where=lambda u: u["id"] == accepted.json()["id"]
    )
    assert (usage[0]["status"], usage[0]["reused_from"]) == ("ok", None)
    assert usage[0]["completion_tokens"] == 12


async def test_a_keystroke_served_from_the_suggestion_has_its_teams_supersede_grace(
    stack: LiveStack, upstream: UpstreamProcess
) -> None:
    """A team lets a completion that streamed 2 tokens finish when a newer keystroke comes.
    A keystroke served from the running suggestion gets what it made past the typed word at
    once (2 words and more): the next keystroke leaves it to finish, as it would a run of its
    own that streamed as much."""
    ingress = await stack.start_ingress()
    worker = await _worker(stack, upstream)
    http = stack.http(ingress, await stack.api_key("team-g", supersede_grace_tokens=2))
    # 40 tokens (2.4 s): the third keystroke comes while the suggestion still runs.
    first, _ = await _first_words(http, "def main():", 3, max_tokens=40)
    typed = asyncio.create_task(
        http.post(
            "/v1/completions",
            **_keystroke("def main():" + WORDS[0], 2, stream=False, max_tokens=40),
        )
    )
    await eventually(lambda: len(worker.runs.following) == 1, 10, "the keystroke following")
    third = await http.post("/v1/completions", **_keystroke("def other():", 3, stream=False))
    second = await typed
    await first.aclose()
    assert third.status_code == 200
    assert second.status_code == 200, second.text
    assert _text(second) == _suggestion(40)[len(WORDS[0]) :]
    usage = await stack.usage_of(second.json()["id"])
    assert usage[second.json()["id"]]["status"] == "ok"
