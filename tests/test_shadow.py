"""Shadow routes: the ingress mirrors whole sessions to the shadow route and the client gets
the primary's answer alone; the mirror is not billed (no quota, no rollup, no breaker) and the
streams app compares its latency and errors with the primary's."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from laneway.canary import bucket
from laneway.constants import RedisKeys
from laneway.errors import BadRequest
from laneway.schema import CancelRecord, RequestEnvelope
from laneway.shadow import (
    ShadowState,
    get_comparison,
    get_shadow,
    mirrored,
    parse_share,
    shadow_envelope,
    start_shadow,
)
from ops.cli import main
from streams.processor import UsageProcessor
from streams.settings import StreamsSettings
from streams.shadow import ShadowWatch
from tests.stack import LiveStack, envelope, eventually, sim_answer_tokens
from tests.test_cancel_shield import until_seen
from tests.test_streams_logic import _Table
from tests.test_streams_process import usage_event

ADMIN = "ops-secret-0123456"
SHADOW = "laneway-code-next"


def test_a_share_is_a_fraction_and_bad_ones_are_named() -> None:
    assert parse_share("0.05") == 0.05
    assert parse_share("1") == 1.0
    for text, words in (
        ("5", "for 5 % write 0.05"),
        ("0", "(0, 1]"),
        ("-0.1", "(0, 1]"),
        ("nan", "(0, 1]"),
        ("five", "not 'five'"),
    ):
        with pytest.raises(BadRequest, match=re.escape(words)) as caught:
            parse_share(text)
        assert caught.value.param == "share"
    with pytest.raises(BadRequest, match="differ"):
        ShadowState(model="m", target="m", share=0.1)


def test_whole_sessions_are_mirrored_and_the_copy_can_reach_no_client() -> None:
    state = ShadowState(model="laneway-code", target=SHADOW, share=0.3, salt="s3cret")
    sessions = [f"src/{i}.py" for i in range(200)]
    picked = {s for s in sessions if mirrored(state, "team-a", s)}
    assert 30 < len(picked) < 90  # about 30 %
    # Whole sessions, by a hash keyed with the shadow's own secret: not one a team can
    # compute to name its sessions into the mirrored share (unbilled engine work).
    assert picked == {s for s in sessions if bucket("team-a", f"s3cret\0{s}") < 30}
    assert picked != {s for s in sessions if bucket("team-a", s) < 30}
    other = state.model_copy(update={"salt": "another"})
    assert picked != {s for s in sessions if mirrored(other, "team-a", s)}
    assert not mirrored(
        state.model_copy(update={"status": "stopped"}), "team-a", next(iter(picked))
    )

    env: RequestEnvelope = envelope(
        session="src/a.py",
        seq=7,
        stream=True,
        reuse=True,
        quota_leased=300,
        reply_to="laneway:replies:ingress-1",
    )
    copy = shadow_envelope(env, SHADOW)
    assert (copy.id, copy.route, copy.model) == (f"{env.id}-shadow", SHADOW, env.model)
    assert (copy.reply_to, copy.stream, copy.reuse, copy.quota_leased) == (None, False, False, 0)
    assert (copy.band, copy.shadow, copy.session, copy.seq) == ("lo", True, "src/a.py", 7)
    assert (copy.affinity, copy.deadline_ts) == (env.affinity, env.deadline_ts)


async def test_the_ingress_mirrors_a_share_and_the_client_gets_the_primary_alone(
    stack: LiveStack,
) -> None:
    # The shadow route fails every request (the simulated engine's injected failure).
    ingress = await stack.start_ingress(admin_key=ADMIN, quota_lease_share=0)
    await stack.start_worker("completion", sim_route_failure_rates={SHADOW: 1.0})
    key = await stack.api_key("team-a", size=10)
    admin = stack.http(ingress, ADMIN)
    http = stack.http(ingress, key)

    for body, param in (
        ({"target": SHADOW, "share": 5}, "share"),
        ({"target": "laneway-code", "share": 0.5}, "target"),
        ({"target": SHADOW}, "share"),
        ({"target": SHADOW, "share": 0.5, "weight": 1}, "weight"),
    ):
        bad = await admin.put("/admin/shadow/laneway-code", json=body)
        assert bad.status_code == 400, body
        assert bad.json()["error"]["param"] == param, bad.text
    long = await admin.put(f"/admin/shadow/{'m' * 201}", json={"target": SHADOW, "share": 0.5})
    assert (long.status_code, long.json()["error"]["param"]) == (400, "model"), long.text
    started = await admin.put("/admin/shadow/laneway-code", json={"target": SHADOW, "share": 0.5})
    assert started.status_code == 201, started.text
    assert (started.json()["share"], started.json()["comparison"]) == (0.5, None)
    again = await admin.put("/admin/shadow/laneway-code", json={"target": "x", "share": 0.1})
    assert again.status_code == 409
    assert "salt" not in started.json()  # the shadow's secret stays in Redis
    shadow = await get_shadow(stack.redis, RedisKeys(stack.prefix), "laneway-code")
    assert shadow is not None
    # The ingress reads the shadow once a second, in the background.
    await _until_mirroring(stack, stack.http(ingress, await stack.api_key("team-w")), shadow)

    sessions = [f"src/mod{i}.py" for i in range(24)]
    ids: dict[str, str] = {}
    for session in sessions:
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": "def f():", "max_tokens": 4},
            headers={"X-Laneway-Session": session},
        )
        assert response.status_code == 200, response.text  # the shadow fails; not this
        assert response.headers["x-laneway-route"] == "laneway-code"
        ids[response.json()["id"]] = session
    mirrored_ids = {rid for rid, s in ids.items() if mirrored(shadow, "team-a", s)}
    assert 0 < len(mirrored_ids) < len(ids)
    shadows = {f"{rid}-shadow" for rid in mirrored_ids}
    events = await stack.read_topic(
        stack.topics.usage,
        count=len(ids) + len(shadows),
        where=lambda e: e["id"] in ids or e["id"] in shadows,
    )
    by_id = {e["id"]: e for e in events}
    for rid in ids:
        assert (by_id[rid]["status"], by_id[rid]["shadow"]) == ("ok", False)
    for sid in shadows:
        assert (by_id[sid]["route"], by_id[sid]["status"], by_id[sid]["shadow"]) == (
            SHADOW,
            "error",
            True,
        )
    # Charged: the primaries' tokens, none of the mirrors' (the quota's hourly counter).
    hour = int(time.time() // 3600)
    keys = RedisKeys(stack.prefix)
    used = [
        await stack.redis.get(keys.quota_used("team-a", "interactive", h)) for h in (hour - 1, hour)
    ]
    charged = sum(int(u or 0) for u in used)
    assert charged == sum(by_id[r]["prompt_tokens"] + by_id[r]["completion_tokens"] for r in ids)

    # A model in trouble (its breaker at level 1) serves its quantized route and is not mirrored.
    await stack.redis.set(keys.breaker("laneway-code"), orjson.dumps({"level": 1, "since": 0}))
    on_shadow = next(s for s in sessions if mirrored(shadow, "team-a", s))

    async def degraded() -> bool:
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": "def g():", "max_tokens": 2},
            headers={"X-Laneway-Session": on_shadow},
        )
        return bool(response.headers["x-laneway-route"] == "laneway-code-fp8")

    await eventually(degraded, 10, "the breaker's level 1 at the ingress")
    skipped = _shadow_count("skipped_breaker")
    for _ in range(3):
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": "def h():", "max_tokens": 2},
            headers={"X-Laneway-Session": on_shadow},
        )
        assert response.status_code == 200, response.text
    assert _shadow_count("skipped_breaker") == skipped + 3

    await ingress.stop()  # every copy it made is on Kafka now
    copies = await stack.read_all(stack.topics.request("completion", "lo"))
    assert {c["id"] for c in copies if c["id"][: -len("-shadow")] in ids} == shadows
    for copy in copies:
        if copy["id"] in shadows:
            assert (copy["reply_to"], copy["shadow"], copy["route"]) == (None, True, SHADOW)


async def test_a_primarys_tombstone_ends_its_copy_before_it_starts_or_running(
    stack: LiveStack,
) -> None:
    # A client that leaves (or DELETEs) cancels its request; the copy has an id of its own
    # that no client knows, so the primary's tombstone must end it too. The copies' answers
    # on the shadow route are 100 tokens or more (6 s and longer): they still run when it
    # comes, however slowly this machine carries the records before it.
    worker = await stack.start_worker("completion", sim_decode_ms_per_step=60.0)
    running, forged, later = (
        envelope(reply_to=f"{stack.prefix}:reply:test", max_tokens=128, prompt=f"def {p}():")
        for p in ("mirrored_8", "mirrored_15", "mirrored_18")
    )
    copies = {e.id: shadow_envelope(e, SHADOW) for e in (running, forged, later)}
    for env in (running, forged):
        await stack.send_records(env, copies[env.id])
    await eventually(
        lambda: {copies[running.id].id, copies[forged.id].id} <= set(worker.executor.live),
        20,
        "both copies running",
    )
    # Another team's tombstone ends nothing (seen by the worker while the copy runs).
    marker = CancelRecord(id=f"marker-{forged.id}", team="team-b")
    await stack.send_records(CancelRecord(id=forged.id, team="team-b"), marker)
    await until_seen(worker, marker)
    assert copies[forged.id].id in worker.executor.live
    # The owner's tombstones: one while the copy runs, one before the copy is even stored.
    await stack.send_records(
        CancelRecord(id=running.id, team=running.team),
        CancelRecord(id=later.id, team=later.team),
        later,
        copies[later.id],
    )

    usage = await stack.usage_of(*copies, *(c.id for c in copies.values()))
    for env in (running, later):
        copy = usage[copies[env.id].id]
        assert copy["status"] == "cancelled", copy
        assert copy["completion_tokens"] < sim_answer_tokens(env.prompt, route=SHADOW)
    assert usage[copies[forged.id].id]["status"] == "ok"


def _shadow_count(outcome: str) -> float:
    labels = {"model": "laneway-code", "outcome": outcome}
    return REGISTRY.get_sample_value("laneway_ingress_shadow_total", labels) or 0.0


async def _until_mirroring(stack: LiveStack, http: Any, shadow: ShadowState) -> None:
    """Send on a mirrored session of team-w until a copy of one shows on the usage topic."""
    session = next(f"warm/{i}" for i in range(100) if mirrored(shadow, "team-w", f"warm/{i}"))
    copies: set[str] = set()

    async def copied() -> bool:
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": "def warm():", "max_tokens": 2},
            headers={"X-Laneway-Session": session},
        )
        copies.add(f"{response.json()['id']}-shadow")
        return bool(await stack.read_all(stack.topics.usage, where=lambda e: e["id"] in copies))

    await eventually(copied, 30, "the first mirrored request")


async def test_the_streams_app_bills_no_mirror_and_compares_it_with_the_primary(
    stack: LiveStack,
) -> None:
    keys = RedisKeys(stack.prefix)
    await start_shadow(stack.redis, keys, "laneway-code", SHADOW, 0.1)
    state = await get_shadow(stack.redis, keys, "laneway-code")
    assert state is not None
    watch = ShadowWatch(StreamsSettings(shadow_window_s=60), stack.redis, keys)
    rollups, outcomes = _Table(), _Table()
    processor = UsageProcessor(
        StreamsSettings(),
        rollups=rollups,
        outcomes=outcomes,
        announcer=None,  # type: ignore[arg-type]
        redis=stack.redis,
        keys=keys,
        send=None,  # type: ignore[arg-type]
        shadow=watch,
    )
    assert await watch.evaluate() != []  # learns which models have a running shadow
    now = time.time()
    events = []
    for i in range(100):
        # The primary: 20 ms on the engine (after 5 ms of queue), no errors.
        events.append(usage_event(id=f"p{i}", ts=now, total_ms=25.0 + i % 2, queue_ms=5.0))
        # Its mirror: 50 ms on the engine after a long lo-band wait, one in five fails.
        events.append(
            usage_event(
                id=f"p{i}-shadow",
                route=SHADOW,
                shadow=True,
                status="error" if i % 5 == 0 else "ok",
                prompt_tokens=1000,
                ts=now,
                total_ms=350.0,
                queue_ms=300.0,
            )
        )
    for offset, event in enumerate(events):
        processor.handle(event.to_json(), 0, offset)

    (rollup,) = rollups.values()
    assert (rollup["requests"], rollup["prompt_tokens"]) == (100, 100 * 100)
    assert all(SHADOW not in key for key in outcomes)  # its errors raise no breaker
    [comparison] = await watch.evaluate()
    assert comparison == await get_comparison(stack.redis, keys, "laneway-code")
    assert comparison.primary is not None
    assert comparison.shadow is not None
    assert (comparison.primary.requests, comparison.primary.errors) == (100, 0)
    assert (comparison.shadow.requests, comparison.shadow.errors) == (100, 20)
    assert (comparison.primary.p50_ms, comparison.primary.p99_ms) == (20.0, 21.0)
    assert (comparison.shadow.p50_ms, comparison.shadow.p99_ms) == (50.0, 50.0)
    ratios: dict[str, Any] = comparison.ratios()
    assert ratios == {"p50_ratio": 2.5, "p99_ratio": round(50 / 21, 3), "error_rate_diff": 0.2}


async def test_the_cli_starts_shows_and_stops_a_shadow_and_names_bad_input(
    stack: LiveStack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("kafka_bootstrap", "redis_url", "redis_prefix", "topic_prefix"):
        monkeypatch.setenv(f"LANEWAY_{name.upper()}", str(stack.common[name]))

    def laneway(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))  # runs its own event loop: off this test's
        out, err = capsys.readouterr()
        return code, out, err

    run = functools.partial(asyncio.to_thread, laneway)
    code, _, err = await run("shadow", "start", "laneway-code", "--to", SHADOW, "--share", "5")
    assert (code, err.strip()) == (
        2,
        "laneway: share must be a fraction in (0, 1], e.g. 0.05 for 5 % of requests; got 5 "
        "(for 5 % write 0.05)",
    )
    code, _, err = await run(
        "shadow", "start", "laneway-code", "--to", "laneway-code", "--share", "0.1"
    )
    assert (code, "must differ from the model" in err) == (2, True)
    code, _, err = await run("shadow", "start", "laneway-cdoe", "--to", SHADOW, "--share", "0.1")
    assert (code, "is not served here" in err, "LANEWAY_MODELS" in err) == (2, True, True)
    code, out, _ = await run("shadow", "start", "laneway-code", "--to", SHADOW, "--share", "0.05")
    assert (code, out.strip()) == (
        0,
        f"shadow laneway-code → {SHADOW}: 5.00% of requests mirrored (answers discarded, "
        "usage marked shadow, not billed)",
    )
    code, _, err = await run("shadow", "start", "laneway-code", "--to", SHADOW, "--share", "0.1")
    assert (code, "already has a shadow running" in err) == (2, True)
    code, out, _ = await run("shadow", "status")
    assert code == 0
    assert "laneway-code → laneway-code-next: running, 5.00% of requests" in out
    assert "no comparison yet" in out

    keys = RedisKeys(stack.prefix)
    watch = ShadowWatch(StreamsSettings(shadow_window_s=60), stack.redis, keys)
    await watch.evaluate()
    for i in range(10):
        watch.fold(usage_event(id=f"q{i}", total_ms=30.0, queue_ms=10.0))
        watch.fold(usage_event(id=f"q{i}-shadow", route=SHADOW, shadow=True, total_ms=40.0))
    await watch.evaluate()
    code, out, _ = await run("shadow", "status")
    assert code == 0
    assert "primary        10       0    0.00%       20       20" in out
    assert "shadow         10       0    0.00%       40       40" in out
    assert "shadow against primary: P50 2.00×, P99 2.00×, error rate +0.00%" in out

    code, out, _ = await run("shadow", "stop", "laneway-code")
    assert (code, "stopped: no more mirrors" in out) == (0, True)
    code, _, err = await run("shadow", "stop", "laneway-code")
    assert (code, "is stopped, not running" in err) == (2, True)
    code, _, err = await run("shadow", "stop", "laneway-chat")
    assert (code, "no shadow for model 'laneway-chat'" in err) == (2, True)
