"""The shield in front of a separate OpenAI-compatible server, judged by that server's log.

The upstream (``bench.upstream_server``) is a process of its own with a fixed number of decode
slots and a per-token time; it cancels a request whose connection closes, queued or running,
as vLLM's server does, and logs what it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from laneway.errors import Aborted
from tests.stack import Ingress, LiveStack, eventually, frozen
from tests.upstream_process import UpstreamProcess
from workers.pool import PoolWorker
from workers.types import EngineRequest
from workers.upstream import OpenAICompatibleEngine

pytestmark = pytest.mark.slow


async def _serving(
    stack: LiveStack, upstream: UpstreamProcess, pool: str = "completion", **options: Any
) -> PoolWorker:
    return await stack.start_worker(
        pool, engine="openai", upstream_url=upstream.url, upstream_model="up", **options
    )


def _completion(prompt: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "laneway-code", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


async def _idle(worker: PoolWorker, upstream: UpstreamProcess) -> None:
    """Nothing waits in the worker or runs on the upstream: every request the upstream ever
    received has ended, so its log is complete."""
    await eventually(
        lambda: not len(worker.queue) and not worker.dispatcher.running, 20, "an idle worker"
    )
    await upstream.until(lambda running, waiting: running == waiting == 0, "an idle upstream")


async def _occupy(http: httpx.AsyncClient, upstream: UpstreamProcess, prompt: str) -> Any:
    """A request that holds the upstream's one slot until ``upstream.release(prompt)`` (so
    nothing races its end); returns its task once it runs. Its ingress needs a start
    deadline that outlasts the hold (``_ingress_with_room``)."""
    await upstream.hold(prompt)
    task = asyncio.create_task(http.post("/v1/completions", json=_completion(prompt, 40)))
    await upstream.until(lambda running, _: running > 0, f"{prompt} to run upstream")
    return task


async def test_a_request_cancelled_while_it_waits_in_laneway_never_starts_upstream(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=1, token_ms=40, metrics=True)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_slots=1)
    http = stack.http(ingress, await stack.api_key())
    occupant = await _occupy(http, upstream, "occupant")
    gone = asyncio.create_task(http.post("/v1/completions", json=_completion("never-run", 8)))
    await eventually(lambda: len(worker.queue) == 1, 10, "the second request to wait in laneway")
    gone.cancel()  # the client goes away: a tombstone
    await eventually(lambda: len(worker.queue) == 0, 10, "the tombstone to drop it")
    await upstream.release("occupant")
    assert (await occupant).status_code == 200
    await _idle(worker, upstream)
    assert upstream.entry("never-run") is None
    assert upstream.entry("occupant")["outcome"] == "done"
    usage = await stack.read_topic(stack.topics.usage, count=2, within_s=20)
    dropped = next(u for u in usage if u["status"] != "ok")
    assert (dropped["status"], dropped["engine_ms"]) == ("cancelled", 0)


async def test_a_request_cancelled_while_queued_upstream_is_taken_off_its_queue(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """Told the upstream runs more than it does, the worker sends work that queues there;
    a cancel closes its connection at once and the upstream never starts it."""
    upstream = await upstreams(slots=1, token_ms=40, metrics=True)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_slots=3)
    http = stack.http(ingress, await stack.api_key())
    occupant = await _occupy(http, upstream, "occupant")
    gone = asyncio.create_task(http.post("/v1/completions", json=_completion("queued-up", 8)))
    await upstream.until(lambda _, waiting: waiting > 0, "a request queued upstream")
    gone.cancel()
    await eventually(lambda: upstream.entry("queued-up") is not None, 10, "the upstream's record")
    entry = upstream.entry("queued-up")
    assert (entry["outcome"], entry["start"]) == ("gone_queued", None)
    await upstream.release("occupant")
    assert (await occupant).status_code == 200
    await _idle(worker, upstream)


async def test_a_cancel_between_tokens_stops_the_upstream_within_a_token(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=150)
    ingress = await stack.start_ingress()
    worker = await _serving(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    received = 0
    body = _completion("cancel-me", 60, stream=True)
    async with http.stream("POST", "/v1/completions", json=body) as response:
        rid = response.headers["x-laneway-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                received += 1
            if received == 3:
                break
        cancelled = await http.delete(f"/v1/requests/{rid}")
        assert cancelled.status_code == 200
    await eventually(lambda: upstream.entry("cancel-me") is not None, 10, "the upstream's record")
    entry = upstream.entry("cancel-me")
    assert entry["outcome"] == "gone_running"
    # What it had made when the client cancelled, plus at most the token under way then and
    # the one under way when the cancel reached it.
    assert entry["tokens"] <= received + 2
    await _idle(worker, upstream)


def _keystroke(http: httpx.AsyncClient, seq: int) -> asyncio.Task[httpx.Response]:
    """Keystroke ``seq`` of one editor session: a completion that supersedes the ones before."""
    headers = {"X-Laneway-Session": "src/app.py", "X-Laneway-Seq": str(seq)}
    body = _completion(f"keystroke-{seq}", 8)
    return asyncio.create_task(http.post("/v1/completions", json=body, headers=headers))


async def _only_the_last_keystroke_ran(
    keystrokes: list[asyncio.Task[httpx.Response]],
    occupant: Any,
    worker: PoolWorker,
    upstream: UpstreamProcess,
) -> None:
    """Each keystroke is dropped (409) when a newer one reaches the worker; the slot is held
    until the first four are, so none of them could have started first."""
    # A bound for a machine that stalls: an overloaded one has frozen the broker and Redis
    # together for longer than 20 s (the frozen-broker test below: the shield answers once
    # they are back).
    await eventually(
        lambda: sum(k.done() for k in keystrokes) >= 4, 60, "four keystrokes superseded"
    )
    await upstream.release("occupant")
    codes = [r.status_code for r in await asyncio.gather(*keystrokes)]
    assert codes == [409, 409, 409, 409, 200]
    assert (await occupant).status_code == 200
    await _idle(worker, upstream)
    reached = sorted(e["prompt"] for e in upstream.entries() if "keystroke" in e["prompt"])
    assert reached == ["keystroke-5"]


async def test_superseded_keystrokes_never_reach_the_upstream(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=1, token_ms=40, metrics=True)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_slots=1)
    http = stack.http(ingress, await stack.api_key())
    occupant = await _occupy(http, upstream, "occupant")
    keystrokes = []
    for seq in range(1, 6):
        keystrokes.append(_keystroke(http, seq))
        await asyncio.sleep(0.02)
    await _only_the_last_keystroke_ran(keystrokes, occupant, worker, upstream)


async def test_keystrokes_fetched_in_one_batch_are_answered_at_once(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """A backlog of one session's keystrokes fetched in one batch (after a rebalance, a
    broker pause, a restart): the stale ones are answered at once, not when the engine's
    slot frees, and none of them reaches the upstream."""
    upstream = await upstreams(slots=1, token_ms=40, metrics=True)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_slots=1)
    http = stack.http(ingress, await stack.api_key())
    occupant = await _occupy(http, upstream, "occupant")
    hi = [tp for tp in worker.consumer.assignment() if tp.topic.endswith(".hi")]
    worker.consumer.pause(*hi)  # the keystrokes pile up on the topic
    keystrokes = [_keystroke(http, seq) for seq in range(1, 6)]
    await stack.read_topic(
        stack.topics.request("completion", "hi"),
        count=5,
        where=lambda e: e["prompt"].startswith("keystroke"),
    )
    worker.consumer.resume(*hi)
    await _only_the_last_keystroke_ran(keystrokes, occupant, worker, upstream)


async def test_keystrokes_typed_while_the_broker_is_frozen_are_shielded_once_it_is_back(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """A broker frozen longer than the worker's group session (a long GC pause, a stalled
    VM): the keystrokes typed meanwhile wait, and once it is back (the group may have taken
    the worker's partitions away and given them back, or not) the stale ones are dropped
    before they reach the upstream, as if nothing had happened."""
    assert stack.services.broker_pid is not None
    upstream = await upstreams(slots=1, token_ms=40, metrics=True)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_slots=1)
    http = stack.http(ingress, await stack.api_key())
    occupant = await _occupy(http, upstream, "occupant")
    keystrokes = [_keystroke(http, 1)]
    await eventually(lambda: len(worker.queue) == 1, 10, "the first keystroke in the worker")
    with frozen(stack.services.broker_pid):
        for seq in range(2, 6):
            keystrokes.append(_keystroke(http, seq))
            await asyncio.sleep(0.02)
        await asyncio.sleep(worker.settings.session_timeout_ms / 1000 + 2)
    await _only_the_last_keystroke_ran(keystrokes, occupant, worker, upstream)


async def test_a_non_streamed_client_that_leaves_cancels_upstream_too(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    upstream = await upstreams(slots=2, token_ms=100, metrics=True)
    ingress = await stack.start_ingress()
    worker = await _serving(stack, upstream)
    http = stack.http(ingress, await stack.api_key())
    leaving = asyncio.create_task(http.post("/v1/completions", json=_completion("leaver", 60)))
    await upstream.until(lambda running, _: running > 0, "the request to run upstream")
    leaving.cancel()  # closes the connection: the ingress sees the disconnect
    await eventually(lambda: upstream.entry("leaver") is not None, 10, "the upstream's record")
    entry = upstream.entry("leaver")
    assert entry["outcome"] == "gone_running"
    assert entry["tokens"] < 30  # 60 would have taken 6 s; it stopped within a few tokens
    await _idle(worker, upstream)


@contextlib.asynccontextmanager
async def _hung_server() -> AsyncIterator[str]:
    """Accepts connections and reads requests, and never answers."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()


async def test_a_hung_upstream_stalls_neither_fetching_nor_other_pools(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    healthy = await upstreams(slots=4, token_ms=5)
    ingress = await stack.start_ingress()
    async with _hung_server() as hung_url:
        await stack.start_worker(
            "completion", engine="openai", upstream_url=hung_url, upstream_metrics_url=""
        )
        await _serving(stack, healthy, "chat")
        http = stack.http(ingress, await stack.api_key())
        deadline = {"X-Laneway-Deadline-Ms": "1000"}
        completions = [
            asyncio.create_task(
                http.post("/v1/completions", json=_completion(f"c{i}", 8), headers=deadline)
            )
            for i in range(10)
        ]
        chat = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            response = await http.post("/v1/chat/completions", json={**chat, "max_tokens": 4})
            assert response.status_code == 200
        # Every completion, sent or still waiting, ends at its deadline: none waits on the
        # hung server's read timeout, and later ones are still fetched and answered.
        codes = [r.status_code for r in await asyncio.gather(*completions)]
        assert codes == [504] * 10
        late = await http.post("/v1/completions", json=_completion("late", 8), headers=deadline)
        assert late.status_code == 504


async def test_the_worker_learns_how_much_the_upstream_runs_at_once(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """No slots configured and no metrics: the worker finds the upstream's 3 slots from its
    first-byte times, and keeps the upstream's own queue near empty."""
    # A request queued upstream waits a whole generation (10 tokens × 60 ms) for its first
    # byte: well past three times an unqueued one even when the test shares its two cores
    # with another test process (at 30 ms a token, a busy run once learned nothing).
    upstream = await upstreams(slots=3, token_ms=60)
    ingress = await _ingress_with_room(stack)
    worker = await _serving(stack, upstream, upstream_metrics_url="")
    http = stack.http(ingress, await stack.api_key(size=100))
    burst = [
        asyncio.create_task(http.post("/v1/completions", json=_completion(f"burst-{i}", 10)))
        for i in range(36)
    ]
    assert {r.status_code for r in await asyncio.gather(*burst)} == {200}
    engine = worker.engine
    assert isinstance(engine, OpenAICompatibleEngine)
    assert engine.learned.learned
    assert 1 <= engine.learned.limit <= 3
    await _idle(worker, upstream)
    entries = [e for e in upstream.entries() if e["prompt"].startswith("burst-")]
    assert len(entries) == 36
    # Queued upstream (no free slot when it arrived, by the upstream's own log): only the few
    # sent while the worker was learning (its first limit is 4, one more than the upstream runs).
    queued_there = [e for e in entries if e["queued"]]
    assert len(queued_there) <= 5


async def _ingress_with_room(stack: LiveStack) -> Ingress:
    # The burst waits its turn in the worker's queue for seconds: a deadline that lets every
    # completion start.
    return await stack.start_ingress(completion_deadline_ms=60_000)


class _PostThenAbort:
    """The engine's session, whose POST is followed, in the same turn of the event loop as
    the response headers arrive, by the engine's abort of the request."""

    def __init__(self, session: Any, engine: OpenAICompatibleEngine, request_id: str) -> None:
        self._session, self._engine, self._request_id = session, engine, request_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def post(self, url: str, **options: Any) -> Any:
        response = await self._session.post(url, **options)
        # Runs before the engine's task resumes with the headers: abort() is synchronous
        # up to its close (driven here as the event loop would, in one step).
        abort = self._engine.abort(self._request_id)
        asyncio.get_running_loop().call_soon(_drive, abort)
        return response


def _drive(coroutine: Any) -> None:
    with contextlib.suppress(StopIteration):
        coroutine.send(None)


async def test_an_abort_as_the_headers_arrive_closes_the_request_before_its_first_token(
    upstreams: Callable[..., Any],
) -> None:
    """vLLM sends a stream's headers at once and its first token after the prefill. An abort
    that came after the headers but before the engine's task took them was not seen until
    that first token: the upstream ran the whole prefill of a request no one wanted. Now its
    connection closes at once (the upstream's own log says so)."""
    upstream = await upstreams(slots=1, token_ms=5)
    await upstream.hold("aborted at the headers")  # its first token waits for a release
    engine = OpenAICompatibleEngine(upstream.url, model="up", slots=1)
    await engine.start()
    try:
        assert engine._session is not None
        engine._session = _PostThenAbort(engine._session, engine, "r")  # type: ignore[assignment]
        request = EngineRequest(id="r", route="up", prompt="aborted at the headers", max_tokens=8)
        with pytest.raises(Aborted):
            await asyncio.wait_for(_drain(engine.generate(request)), 10)
        await eventually(
            lambda: upstream.entry("aborted at the headers") is not None, 10, "its record"
        )
        entry = upstream.entry("aborted at the headers")
        assert (entry["outcome"], entry.get("tokens", 0)) == ("gone_running", 0)
    finally:
        await engine.stop()


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _delta in stream:
        pass


async def test_a_request_the_upstream_never_starts_holds_the_pool_one_probe_interval_at_most(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """No slots configured and no metrics: a request the upstream keeps without a first byte
    (stuck on its own, with slots to spare) is taken for a stall and holds the rest back,
    but only until a probe shows that the upstream starts other requests at once."""
    upstream = await upstreams(slots=4, token_ms=5)
    ingress = await _ingress_with_room(stack)  # the stuck one's deadline is a minute away
    worker = await _serving(stack, upstream, upstream_metrics_url="")
    key = await stack.api_key(size=100)
    http = stack.http(ingress, key)
    # Its client waits longer than the test: a client leaving would end the hold by itself.
    stuck = await _occupy(stack.http(ingress, key, timeout=120), upstream, "stuck")
    engine = worker.engine
    assert isinstance(engine, OpenAICompatibleEngine)
    await asyncio.sleep(1)  # past what a first byte may take before any was seen (0.5 s)
    behind = [
        asyncio.create_task(http.post("/v1/completions", json=_completion(f"behind-{i}", 4)))
        for i in range(3)
    ]
    await eventually(lambda: engine.learned.stalls > 0, 20, "the stuck request judged a stall")
    # Before, they waited for the stuck one's deadline (a minute); now for one probe
    # interval (10 s).
    codes = [r.status_code for r in await asyncio.wait_for(asyncio.gather(*behind), 30)]
    assert codes == [200] * 3
    assert not stuck.done()
    await upstream.release("stuck")
    assert (await stuck).status_code == 200


async def test_a_chat_left_while_its_resend_waits_upstream_never_starts_there(
    stack: LiveStack, upstreams: Callable[..., Any]
) -> None:
    """A chat that set no length, refused at once for laneway's cap (its prompt near the
    context), is sent again with the room the refusal names. Its client leaving while that
    second request waits in the upstream's queue closes it there at once: the abort closed
    the refused response, already read, and the second one waited on, started, and ran."""
    upstream = await upstreams(slots=1, token_ms=5, max_model_len=100)
    ingress = await stack.start_ingress(completion_deadline_ms=60_000, chat_max_tokens=60)
    await _serving(stack, upstream, upstream_slots=2)
    await _serving(stack, upstream, "chat", upstream_slots=2)
    key = await stack.api_key(size=100)
    holder = await _occupy(stack.http(ingress, key, timeout=120), upstream, "holder")
    near = {"model": "laneway-chat", "messages": [{"role": "user", "content": "near-" + "y" * 195}]}
    leaving = asyncio.create_task(stack.http(ingress, key).post("/v1/chat/completions", json=near))
    await upstream.until(lambda _, waiting: waiting == 1, "the chat sent again, queued upstream")
    leaving.cancel()  # its client closes the connection
    await asyncio.gather(leaving, return_exceptions=True)

    def resent() -> dict[str, Any] | None:
        ended = [e for e in upstream.entries() if e["prompt"].startswith("near-")]
        return next((e for e in ended if e["outcome"] != "refused"), None)

    gone = await eventually(resent, 20, "the chat sent again, gone from the upstream's queue")
    assert (gone["outcome"], gone["start"], gone["sampling"]["max_tokens"]) == (
        "gone_queued",
        None,
        50,
    )
    await upstream.release("holder")
    assert (await holder).status_code == 200
