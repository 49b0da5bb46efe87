"""Memory pressure: batch and lo-band work make way, run again later, and nothing is lost."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from laneway.batch import BatchClient
from laneway.constants import RedisKeys
from laneway.errors import Aborted, Cancelled, EngineError
from laneway.schema import RequestEnvelope
from laneway.settings import CommonSettings
from tests.stack import LiveStack, envelope, eventually, sim_answer_tokens
from tests.upstream_process import UpstreamProcess
from workers.dispatch import Dispatcher, DispatchQueue, Work
from workers.memory import PressureGauge, sheddable
from workers.pool import PoolWorker
from workers.settings import WorkerSettings
from workers.sim import SimEngine, SimProfile
from workers.types import EngineRequest
from workers.upstream import OpenAICompatibleEngine


def test_pressure_begins_at_the_mark_and_ends_only_after_a_low_cooldown() -> None:
    gauge = PressureGauge(shed_at=0.9, resume_at=0.8, cooldown_s=5.0)
    assert gauge.observe(0.0, 0.89) is None
    assert gauge.observe(1.0, 0.9) is True
    assert gauge.observe(2.0, 0.85) is None  # between the marks: still pressed
    assert gauge.observe(3.0, 0.5) is None  # low, cooling down
    assert gauge.observe(4.0, 0.95) is None  # high again: the cool-down starts over
    assert gauge.observe(5.0, 0.5) is None
    assert gauge.observe(9.9, 0.79) is None
    assert gauge.observe(10.0, 0.7) is False
    assert not gauge.pressed
    assert gauge.observe(11.0, 0.85) is None  # below the mark: no new pressure


def test_resume_mark_must_be_below_the_shed_mark() -> None:
    with pytest.raises(ValidationError, match="must be below LANEWAY_MEMORY_SHED_AT"):
        WorkerSettings(memory_shed_at=0.8, memory_resume_at=0.8)


def _env(rid: str, band: str, cls: str = "completion") -> RequestEnvelope:
    return envelope(id=rid, band=band, cls=cls, kind="chat" if cls == "chat" else "completion")


def test_only_batch_and_the_lo_band_are_sheddable() -> None:
    assert sheddable(_env("a", "lo"))
    assert sheddable(_env("b", "hi", cls="batch"))
    assert not sheddable(_env("c", "hi"))
    assert not sheddable(_env("d", "hi", cls="chat"))


def test_held_work_waits_first_in_line_while_hi_work_starts() -> None:
    queue = DispatchQueue()
    started: list[str] = []
    held = {"on": True}
    dispatcher = Dispatcher(
        queue,
        capacity=lambda: 8,
        verdict=lambda _env, _now: None,
        start=lambda work: started.append(work.env.id),
        drop=lambda _work, _reason: None,
        held=lambda env: held["on"] and sheddable(env),
    )
    tp = object()
    for rid, band in (("lo-1", "lo"), ("hi-1", "hi"), ("lo-2", "lo"), ("hi-2", "hi")):
        queue.push(Work(tp, 0, _env(rid, band)))  # type: ignore[arg-type]
    dispatcher.dispatch()
    assert started == ["hi-1", "hi-2"]
    assert len(queue) == 2
    held["on"] = False
    dispatcher.dispatch()
    assert started == ["hi-1", "hi-2", "lo-1", "lo-2"]


async def test_a_simulated_hold_counts_in_the_engines_kv_usage() -> None:
    engine = SimEngine(
        SimProfile(prefill_ms_per_token=0.0, decode_ms_per_step=50.0, kv_tokens=1000)
    )
    engine.hold_kv(0.5)
    assert engine.stats().kv_cache_usage == 0.5
    stream = engine.generate(EngineRequest(id="a", route="m", prompt="d" * 1600, max_tokens=8))
    await anext(stream)  # 400 prompt tokens on the engine
    assert 0.9 <= engine.stats().kv_cache_usage < 0.95
    await engine.abort("a")
    with pytest.raises(Exception, match="aborted"):
        await anext(stream)
    engine.hold_kv(0.0)
    assert engine.stats().kv_cache_usage == 0.0


def _long_prompts(count: int, min_tokens: int, route: str = "laneway-code") -> list[str]:
    """Distinct prompts whose simulated answers are at least ``min_tokens`` long."""
    found = []
    for i in range(5000):
        prompt = f"def handler_{i}(request):"
        if sim_answer_tokens(prompt, route=route, max_tokens=64) >= min_tokens:
            found.append(prompt)
            if len(found) == count:
                return found
    raise ValueError(f"not {count} prompts with a {min_tokens}-token answer")


def _expected_text(prompt: str, route: str = "laneway-code") -> str:
    request = EngineRequest(id="x", route=route, prompt=prompt, max_tokens=64)
    return "".join(SimEngine()._completion_words(request))


async def _complete(
    http: httpx.AsyncClient, prompt: str, band: str, *, stream: bool
) -> tuple[str, str]:
    """(request id, text) of one completion, streamed or not."""
    body = {"model": "laneway-code", "prompt": prompt, "max_tokens": 64, "stream": stream}
    headers = {"X-Laneway-Priority": band}
    if not stream:
        response = await http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.headers["x-laneway-request-id"], response.json()["choices"][0]["text"]
    parts: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        rid = response.headers["x-laneway-request-id"]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            parts += [choice.get("text", "") for choice in chunk["choices"]]
    return rid, "".join(parts)


async def test_lo_band_work_is_shed_under_pressure_and_finished_after(stack: LiveStack) -> None:
    # The pressure outlasts the completions' start deadline: work shed after it started met
    # it, and still runs to its end when the pressure is over.
    deadline_s = 10.0
    ingress = await stack.start_ingress(completion_deadline_ms=int(deadline_s * 1000))
    # Answers of 46 tokens and more at 60 ms a step (2.8 s): all six lo requests run at once
    # however slowly Kafka brings them.
    worker = await stack.start_worker(
        "completion",
        sim_decode_ms_per_step=60.0,
        memory_check_ms=20,
        memory_cooldown_s=0.2,
    )
    http = stack.http(ingress, await stack.api_key("ide", size=1000))
    lo_prompts = _long_prompts(6, 40)
    hi_prompts = _long_prompts(9, 40)[6:]
    sent = time.time()
    lo = [
        asyncio.create_task(_complete(http, prompt, "lo", stream=i % 2 == 0))
        for i, prompt in enumerate(lo_prompts)
    ]
    await eventually(
        lambda: len(worker.executor.live) == len(lo_prompts), 20, "the lo work on the engine"
    )

    await _hold(stack, 0.95, worker)  # simulated: memory held by something else
    await eventually(lambda: not worker.running, 10, "every lo request shed")
    assert worker.memory.pressed
    assert len(worker.queue) == len(lo_prompts)  # waiting to run again, none lost
    # Hi-band work is never shed and starts as ever, while the lo band still waits.
    hi = await asyncio.gather(*[_complete(http, p, "hi", stream=False) for p in hi_prompts])
    assert not any(task.done() for task in lo)
    assert [text for _, text in hi] == [_expected_text(p) for p in hi_prompts]

    await eventually(lambda: time.time() > sent + deadline_s, 30, "the lo deadlines to pass")
    assert worker.memory.pressed  # held past the deadlines
    await _hold(stack, 0.0, worker)
    answers = await asyncio.gather(*lo)
    # Every client got its whole answer once: a streamed re-run repeats what was already
    # sent, and the ingress passes on only what is new.
    assert [text for _, text in answers] == [_expected_text(p) for p in lo_prompts]
    lo_ids = {rid for rid, _ in answers}
    hi_ids = {rid for rid, _ in hi}
    usage = await stack.read_topic(
        stack.topics.usage, count=len(lo_ids | hi_ids), where=lambda e: e["id"] in lo_ids | hi_ids
    )
    assert {e["status"] for e in usage} == {"ok"}
    assert sorted(e["id"] for e in usage) == sorted(lo_ids | hi_ids)  # one event each
    assert all(e["preempted"] >= 1 for e in usage if e["id"] in lo_ids)
    assert all(e["preempted"] == 0 for e in usage if e["id"] in hi_ids)
    control = await stack.read_topic(
        stack.topics.control,
        count=2,
        where=lambda r: r.get("kind") == "memory" and r["worker"] == worker.settings.worker_id,
    )
    assert [r["pressed"] for r in control] == [True, False]
    assert control[1]["shed"] >= len(lo_prompts)


async def test_a_request_shed_and_started_again_still_obeys_a_cancel(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(completion_deadline_ms=30_000)
    worker = await stack.start_worker(
        "completion", sim_decode_ms_per_step=60.0, memory_check_ms=20, memory_cooldown_s=0.2
    )
    http = stack.http(ingress, await stack.api_key("ide", size=1000))
    prompts = _long_prompts(2, 40)
    calls = {
        prompt: asyncio.create_task(
            http.post(
                "/v1/completions",
                json={"model": "laneway-code", "prompt": prompt, "max_tokens": 64},
                headers={"X-Laneway-Priority": "lo"},
            )
        )
        for prompt in prompts
    }
    await eventually(lambda: len(worker.executor.live) == 2, 20, "the lo work on the engine")
    await _hold(stack, 0.95, worker)
    await eventually(lambda: not worker.running, 10, "both shed")
    assert len(worker.queue) == 2
    victim = next(iter(worker.queue)).env
    await _hold(stack, 0.0, worker)
    await eventually(lambda: len(worker.executor.live) == 2, 10, "both running again")
    # Running again, its cancel aborts it as any running request's (the run that was shed
    # is not the request's end).
    assert (await http.delete(f"/v1/requests/{victim.id}")).status_code == 200
    (kept_prompt,) = set(prompts) - {victim.prompt}
    cancelled, kept = await calls[victim.prompt], await calls[kept_prompt]
    assert cancelled.status_code == 409, cancelled.text  # its client hears it was cancelled
    assert kept.status_code == 200, kept.text
    assert kept.json()["choices"][0]["text"] == _expected_text(kept_prompt)
    kept_id = kept.headers["x-laneway-request-id"]
    usage = await stack.read_topic(
        stack.topics.usage, count=2, where=lambda e: e["id"] in {victim.id, kept_id}
    )
    outcome = {e["id"]: e["status"] for e in usage}
    assert outcome == {victim.id: "cancelled", kept_id: "ok"}, outcome


async def test_a_cancel_that_comes_while_a_shed_is_under_way_ends_the_request(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine takes a moment to stop a run memory pressure sheds; a tombstone that comes
    meanwhile is the request's end: it is not queued to run again, to its end, for a client
    that left."""
    ingress = await stack.start_ingress(completion_deadline_ms=30_000)
    worker = await stack.start_worker(
        "completion", sim_decode_ms_per_step=60.0, memory_check_ms=20, memory_cooldown_s=0.2
    )
    http = stack.http(ingress, await stack.api_key("ide", size=1000))
    abort, stopping, stop = worker.engine.abort, asyncio.Event(), asyncio.Event()

    async def abort_slowly(request_id: str) -> None:
        stopping.set()
        await stop.wait()
        await abort(request_id)

    monkeypatch.setattr(worker.engine, "abort", abort_slowly)
    (prompt,) = _long_prompts(1, 40)
    call = asyncio.create_task(
        http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": prompt, "max_tokens": 64},
            headers={"X-Laneway-Priority": "lo"},
        )
    )
    await eventually(lambda: len(worker.executor.live) == 1, 20, "the lo request on the engine")
    (rid,) = worker.executor.live
    await _hold(stack, 0.95, worker)
    await eventually(stopping.is_set, 10, "the shed under way")
    assert (await http.delete(f"/v1/requests/{rid}")).status_code == 200
    await eventually(
        lambda: isinstance(worker.shield.stale_reason(rid), Cancelled), 10, "the cancel arrived"
    )
    stop.set()
    await _hold(stack, 0.0, worker)
    answer = await call
    assert answer.status_code == 409, answer.text  # its client hears it was cancelled
    (event,) = await stack.read_topic(stack.topics.usage, count=1, where=lambda e: e["id"] == rid)
    assert event["status"] == "cancelled", event
    assert not worker.queue  # not waiting to run again


async def test_a_drills_hold_in_redis_reaches_the_simulated_engine(stack: LiveStack) -> None:
    worker = await stack.start_worker("chat")
    engine = worker.engine
    assert isinstance(engine, SimEngine)
    key = worker.keys.sim_kv_hold()
    await stack.redis.set(key, "0.93", ex=60)
    await eventually(lambda: worker.memory.pressed, 10, "the hold to press the engine")
    # What the drill reads: the heartbeat shows the usage and the pressure.
    await eventually(lambda: _beat_pressed(stack, worker), 10, "a heartbeat under pressure")
    await stack.redis.set(key, "a lot", ex=60)  # bad input: ignored, and said so
    await eventually(lambda: engine.stats().kv_cache_usage == 0.0, 10, "a bad hold ignored")
    await stack.redis.delete(key)


async def _beat_pressed(stack: LiveStack, worker: Any) -> bool:
    raw = await stack.redis.get(worker.keys.worker_info(worker.settings.worker_id))
    beat = orjson.loads(raw) if raw is not None else {}
    return bool(beat.get("memory_pressure")) and beat["kv_cache_usage"] >= 0.9


@pytest.mark.parametrize("ends", ["aborted", "upstream gone"])
async def test_an_upstreams_kv_cache_usage_is_read_from_its_metrics_while_they_answer(
    tmp_path: Path, ends: str
) -> None:
    """A separate server publishing vLLM's vllm:kv_cache_usage_perc (its one slot: 0 or 1).
    Aborted, the request leaves the cache empty, as the next reading says. Gone with the
    upstream (restarted; or a proxy in front of it answers 404), its metrics say nothing
    more: the last reading stood for good, and the worker's batch and low-band work was held
    under a pressure no one would end. Three readings missed, it no longer counts."""
    upstream = UpstreamProcess(tmp_path / "upstream.jsonl", slots=1, token_ms=40, metrics=True)
    engine = OpenAICompatibleEngine(
        upstream.url,
        model="up",
        slots=1,
        metrics_url=f"http://127.0.0.1:{upstream.port}/metrics",
        metrics_interval_s=0.05,
    )
    try:
        await upstream.ready()
        await engine.start()
        request = EngineRequest(id="kv", route="up", prompt="def f():", max_tokens=1000)
        stream = engine.generate(request)
        await anext(stream)
        await eventually(lambda: engine.stats().kv_cache_usage == 1.0, 10, "a full cache")
        if ends == "aborted":
            await engine.abort("kv")
        else:
            upstream.stop()  # its metrics go with it, mid-request
        with pytest.raises(Aborted if ends == "aborted" else EngineError):
            async for _delta in stream:
                pass
        await eventually(lambda: engine.stats().kv_cache_usage == 0.0, 10, "an empty cache")
    finally:
        await engine.stop()
        upstream.stop()


async def test_a_shared_engine_sheds_its_lo_band_only_once_no_batch_runs_on_it(
    stack: LiveStack,
) -> None:
    # Two pools declared as one engine (LANEWAY_ENGINE_ID): under pressure batch makes way
    # first. Each worker's simulated engine stands in for the shared one; one hold presses
    # both at once, as one engine's full KV cache would.
    ingress = await stack.start_ingress()
    shared: dict[str, Any] = {
        "engine_id": "gpu-shared",
        "sim_decode_ms_per_step": 100.0,
        "memory_check_ms": 20,
        "memory_cooldown_s": 0.2,
    }
    completion = await stack.start_worker("completion", **shared)
    batch = await stack.start_worker("batch", **shared)
    fleet = completion.fleet
    assert fleet is not None
    http = stack.http(ingress, await stack.api_key("ide", size=1000))
    lines = [_batch_line(i) for i in range(8)]
    async with BatchClient(CommonSettings(**stack.common)) as client:
        job = await client.submit(lines, team="team-a")
        await eventually(lambda: fleet.running()["batch"] >= 4, 20, "batch seen on the engine")
        lo_prompts = _long_prompts(2, 40)
        lo = [asyncio.create_task(_complete(http, p, "lo", stream=False)) for p in lo_prompts]
        await eventually(lambda: len(completion.executor.live) == 2, 20, "the lo work running")

        # Each lo request the completion side sheds: how much batch ran on the engine then.
        batch_running_at_lo_shed: list[int] = []
        preempt = completion.executor.preempt

        async def noted(request_id: str, **options: Any) -> bool:
            batch_running_at_lo_shed.append(len(batch.executor.live))
            return await preempt(request_id, **options)

        completion.executor.preempt = noted  # type: ignore[method-assign]
        assert len(batch.executor.live) > 0  # batch runs when the pressure comes
        await _hold(stack, 0.95, completion, batch)
        await eventually(lambda: completion.memory.shed_total == 2, 20, "the lo band shed")
        assert batch_running_at_lo_shed == [0, 0]  # the lo band went only once batch had
        assert batch.memory.shed_total > 0

        await _hold(stack, 0.0, completion, batch)
        answers = await asyncio.gather(*lo)
        assert [text for _, text in answers] == [_expected_text(p) for p in lo_prompts]
        status = await _job_done(client, job, len(lines))
    assert (status.done, status.ok, status.duplicates) == (len(lines), len(lines), 0)


async def _hold(stack: LiveStack, share: float, *workers: PoolWorker) -> None:
    """The drill's simulated hold of KV memory, taken by every worker at once: in Redis (what
    each worker reads again at its beat) and on each engine now (not at the next beat)."""
    await stack.redis.set(RedisKeys(stack.prefix).sim_kv_hold(), str(share), ex=300)
    for worker in workers:
        engine = worker.engine
        assert isinstance(engine, SimEngine)
        engine.hold_kv(share)


def _batch_line(i: int) -> str:
    body = {"model": "laneway-code", "prompt": f"def doc_{i}():", "max_tokens": 128}
    line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions", "body": body}
    return orjson.dumps(line).decode()


async def _job_done(client: BatchClient, job: str, lines: int) -> Any:
    async def done() -> bool:
        return (await client.status(job)).done == lines

    await eventually(done, 120, f"job {job}'s {lines} lines")
    return await client.status(job)
