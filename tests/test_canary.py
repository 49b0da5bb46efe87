"""Canary routes on the real stack: the ingress sends sticky sessions to the canary at its
weight, the streams app walks a healthy canary to 100 % and rolls a faulty one back with an
event on ``laneway.control`` and one on-call webhook."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from laneway.canary import (
    CanaryState,
    abort_canary,
    bucket,
    canary_route,
    get_canary,
    put_canary,
    start_canary,
)
from laneway.constants import RedisKeys
from streams.canary import CanaryWatch
from streams.oncall import OnCallWebhook
from streams.settings import StreamsSettings
from tests.stack import LiveStack, eventually
from tests.test_breaker_levels import Webhook
from tests.test_streams_process import StreamsProcess, produce_usage, usage_event

ADMIN = "ops-secret-0123456"


async def test_the_ingress_sends_sticky_sessions_to_the_canary(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    await stack.start_worker("completion")
    key = await stack.api_key("team-a")
    admin = stack.http(ingress, ADMIN)
    http = stack.http(ingress, key)

    bad = await admin.put("/admin/canary/laneway-code", json={"target": "v2", "steps": [5, 1]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "steps"
    long_name = await admin.put(f"/admin/canary/{'m' * 201}", json={"target": "v2"})
    assert long_name.status_code == 400, long_name.text
    assert long_name.json()["error"]["param"] == "model"
    # A model no client can ask for (a typo) would show "running" for ever, with no traffic.
    for kind, body in (("canary", {"target": "v2"}), ("shadow", {"target": "v2", "share": 0.1})):
        typo = await admin.put(f"/admin/{kind}/laneway-cdoe", json=body)
        assert typo.status_code == 404, typo.text
        assert typo.json()["error"]["code"] == "model_not_found"
        assert "laneway-code" in typo.json()["error"]["message"]  # what is served
    assert (await admin.get("/admin/canary")).json()["data"] == []
    started = await admin.put(
        "/admin/canary/laneway-code", json={"target": "laneway-code-v2", "steps": [50, 100]}
    )
    assert started.status_code == 201, started.text
    assert started.json()["weight"] == 50
    again = await admin.put("/admin/canary/laneway-code", json={"target": "laneway-code-v3"})
    assert again.status_code == 409
    assert "salt" not in started.json()  # the canary's secret stays in Redis
    canary = await get_canary(stack.redis, RedisKeys(stack.prefix), "laneway-code")
    assert canary is not None

    sessions = [f"src/mod{i}.py" for i in range(12)]
    ids: dict[str, str] = {}
    for rnd in range(3):
        for session in sessions:
            response = await http.post(
                "/v1/completions",
                json={"model": "laneway-code", "prompt": f"def f{rnd}():", "max_tokens": 4},
                headers={"X-Laneway-Session": session, "X-Laneway-Seq": str(rnd + 1)},
            )
            assert response.status_code == 200, response.text
            ids[response.json()["id"]] = session
    events = await stack.read_topic(
        stack.topics.usage, count=len(ids), where=lambda e: e["id"] in ids
    )
    routes: dict[str, set[str]] = defaultdict(set)
    for event in events:
        assert event["model"] == "laneway-code"
        routes[ids[event["id"]]].add(event["route"])
    for session in sessions:
        want = canary_route(canary, "team-a", session) or "laneway-code"
        assert routes[session] == {want}, session  # every request of a session, one route
    assert {r for rs in routes.values() for r in rs} == {"laneway-code", "laneway-code-v2"}

    aborted = await admin.post("/admin/canary/laneway-code/abort")
    assert (aborted.status_code, aborted.json()["status"]) == (200, "aborted")
    on_canary = next(s for s in sessions if canary_route(canary, "team-a", s))

    async def back_on_stable() -> bool:
        response = await http.post(
            "/v1/completions",
            json={"model": "laneway-code", "prompt": "def g():", "max_tokens": 4},
            headers={"X-Laneway-Session": on_canary},
        )
        rid = response.json()["id"]
        [event] = await stack.read_topic(
            stack.topics.usage, count=1, where=lambda e: e["id"] == rid
        )
        return bool(event["route"] == "laneway-code")

    await eventually(back_on_stable, 10, "the aborted canary's sessions back on the stable route")
    listed = (await admin.get("/admin/canary")).json()["data"]
    assert [(c["model"], c["status"], c["weight"]) for c in listed] == [
        ("laneway-code", "aborted", 0)
    ]
    assert "salt" not in listed[0]


async def test_a_team_cannot_compute_which_of_its_sessions_land_on_the_canary(
    stack: LiveStack,
) -> None:
    """The sticky bucket is keyed with a secret drawn when the canary starts: sessions a team
    finds under the weight with the public hash alone (to send a step the slow prompts that
    roll it back, or the cheap successes that promote it) are on the canary no more often than
    any others. The secret is the canary's for its life, so sessions still only move to it."""
    keys = RedisKeys(stack.prefix)
    sessions = (f"src/mod{i}.py" for i in range(20_000))
    chosen = [s for s in sessions if bucket("team-a", s) < 5]  # computed offline
    shares = []
    for _ in range(3):  # fresh canaries, each with its own secret
        state = await start_canary(stack.redis, keys, "code", "code-v2", (5, 50, 100))
        on_canary = [s for s in chosen if canary_route(state, "team-a", s) == "code-v2"]
        shares.append(len(on_canary) / len(chosen))
        stored = await get_canary(stack.redis, keys, "code")
        assert stored is not None
        assert all(canary_route(stored, "team-a", s) == "code-v2" for s in on_canary)
        grown = stored.advanced(now=stored.since + 60)
        assert all(canary_route(grown, "team-a", s) == "code-v2" for s in on_canary)
        await abort_canary(stack.redis, keys, "code")
    assert max(shares) < 0.2, shares  # about 5 % each: the weight, as for any session


async def test_a_canary_and_a_shadow_of_a_model_whose_name_has_a_slash(stack: LiveStack) -> None:
    """vLLM serves models by their hub name (``Qwen/Qwen2.5-Coder-7B``): the admin routes take
    the model as the rest of the path, slash or ``%2F`` alike."""
    served = ["laneway-code", "laneway-chat", "org/m", "Qwen/Qwen2.5-Coder-7B"]
    ingress = await stack.start_ingress(admin_key=ADMIN, models=served)
    admin = stack.http(ingress, ADMIN)
    started = await admin.put("/admin/canary/org/m", json={"target": "org/m-v2"})
    assert started.status_code == 201, started.text
    assert (started.json()["model"], started.json()["target"]) == ("org/m", "org/m-v2")
    listed = (await admin.get("/admin/canary")).json()["data"]
    assert [c["model"] for c in listed] == ["org/m"]
    aborted = await admin.post("/admin/canary/org%2Fm/abort")
    assert (aborted.status_code, aborted.json()["status"]) == (200, "aborted"), aborted.text

    model = "Qwen/Qwen2.5-Coder-7B"
    shadow = await admin.put(f"/admin/shadow/{model}", json={"target": "v2", "share": 0.1})
    assert shadow.status_code == 201, shadow.text
    assert shadow.json()["model"] == model
    stopped = await admin.post(f"/admin/shadow/{model}/stop")
    assert (stopped.status_code, stopped.json()["status"]) == (200, "stopped"), stopped.text
    # The names the routes had before still reach the same operations.
    plain = await admin.put("/admin/canary/laneway-code", json={"target": "laneway-code-v2"})
    assert plain.status_code == 201, plain.text
    assert (await admin.post("/admin/canary/laneway-code/abort")).status_code == 200


async def test_a_healthy_canary_is_promoted_and_a_faulty_one_rolled_back(
    stack: LiveStack, tmp_path: Path
) -> None:
    keys = RedisKeys(stack.prefix)
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(5, 50, 100))
    )
    await put_canary(stack.redis, keys, CanaryState(model="chat", target="chat-v2", steps=(5, 100)))
    webhook = Webhook()
    url = await webhook.start()
    streams = StreamsProcess(
        stack,
        tmp_path,
        canary_window_s=1.0,
        canary_min_requests=20,
        breaker_webhook_url=url,
    )
    await streams.start()
    producer = await stack.producer()

    async def traffic() -> None:
        # 40 events a second per route: twice what a 1 s window needs (20), and no more, so a
        # streams app short of CPU on a loaded machine is not buried under a backlog it must
        # work through before it can judge the next step.
        while True:
            events = []
            for i in range(10):
                events += [
                    usage_event(model="code", route="code"),
                    usage_event(model="code", route="code-v2"),
                    usage_event(model="chat", route="chat"),
                    # the faulty canary: one request in five fails
                    usage_event(model="chat", route="chat-v2", status="ok" if i % 5 else "error"),
                ]
            await produce_usage(producer, stack.topics.usage, events)
            await asyncio.sleep(0.25)

    def pages() -> list[dict[str, Any]]:
        # (The faulty route's own breaker pages on-call too; the canary's page is its own.)
        return [b for b in webhook.bodies if b.get("kind") == "canary"]

    feeding = asyncio.create_task(traffic())
    try:

        async def settled() -> tuple[CanaryState, CanaryState] | None:
            code = await get_canary(stack.redis, keys, "code")
            chat = await get_canary(stack.redis, keys, "chat")
            assert code is not None
            assert chat is not None
            done = code.status != "running" and chat.status != "running"
            return (code, chat) if done else None

        code, chat = await eventually(settled, 60, "both canaries judged to the end")
        await eventually(lambda: bool(pages()), 10, "the on-call webhook")
    finally:
        feeding.cancel()
        assert await streams.stop() == 0, streams.log()
        await webhook.stop()
    assert code.status == "promoted", code
    assert chat.status == "rolled_back", chat
    assert "error rate" in chat.reason

    changes = await stack.read_all(stack.topics.control, where=lambda r: r["kind"] == "canary")
    steps: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for change in changes:
        steps[change["model"]].append((change["status"], change["weight"]))
    assert steps["code"] == [("running", 50), ("promoted", 100)]
    assert steps["chat"] == [("rolled_back", 0)]  # at its first step: within one window
    rollback: dict[str, Any] = next(c for c in changes if c["model"] == "chat")
    assert rollback["canary"]["error_rate"] > rollback["stable"]["error_rate"]
    assert [(b["model"], b["status"]) for b in pages()] == [("chat", "rolled_back")]
    assert "rolled back" in pages()[0]["text"]


async def test_batch_traffic_on_the_stable_route_does_not_flatter_a_slow_canary(
    stack: LiveStack,
) -> None:
    """A batch line's time counts its wait in Kafka (minutes to hours), and batch never takes
    a canary route: folded into the stable side, it would raise the stable P99 the canary is
    held to, and a canary twice as slow as the stable route would be promoted."""
    keys = RedisKeys(stack.prefix)
    began = 1_000_000.0
    await put_canary(
        stack.redis,
        keys,
        CanaryState(model="code", target="code-v2", steps=(5, 100), started=began, since=began),
    )
    now = began
    settings = StreamsSettings(canary_window_s=1.0, canary_min_requests=20)
    sent: list[bytes] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        sent.append(value)

    watch = CanaryWatch(settings, stack.redis, keys, send, OnCallWebhook(""), clock=lambda: now)
    assert await watch.evaluate() == []  # the canary is read; its step has not run its window
    for i in range(100):
        ts = began + i / 100
        watch.fold(usage_event(model="code", route="code", total_ms=100.0, ts=ts))
        watch.fold(usage_event(model="code", route="code-v2", total_ms=200.0, ts=ts))
        watch.fold(
            usage_event(model="code", route="code", cls="batch", total_ms=3_600_000.0, ts=ts)
        )
    now = began + 2
    (change,) = await watch.evaluate()
    assert change.status == "rolled_back", change
    assert "P99 200 ms" in change.reason
    assert change.stable is not None
    assert change.stable.p99_ms == 100.0


async def _watch(
    stack: LiveStack, clock: Callable[[], float], **settings: Any
) -> tuple[CanaryWatch, RedisKeys]:
    keys = RedisKeys(stack.prefix)

    async def send(topic: str, key: bytes, value: bytes) -> None:
        pass

    watch = CanaryWatch(
        StreamsSettings(**settings), stack.redis, keys, send, OnCallWebhook(""), clock=clock
    )
    return watch, keys


async def test_a_canary_whose_engine_hangs_is_rolled_back(stack: LiveStack) -> None:
    """Its runs start and never answer: the next keystroke supersedes each (or the client
    leaves, or it expires) long before the upstream's timeout would make it an error. Judged
    on ok and error alone, its step never had the requests it needed and its sessions were
    served nothing for as long as it lasted."""
    began, now = 1_000_000.0, 1_000_000.0
    watch, keys = await _watch(stack, lambda: now, canary_window_s=1.0, canary_min_requests=20)
    for model in ("code", "chat"):
        await put_canary(
            stack.redis,
            keys,
            CanaryState(model=model, target=f"{model}-v2", steps=(5, 100), since=began),
        )
    assert await watch.evaluate() == []
    left = ("superseded", "cancelled", "aborted", "expired")
    for i in range(100):
        ts = began + i / 100
        # The stable routes: most runs answered, a keystroke superseded now and then.
        for model in ("code", "chat"):
            status = "superseded" if i % 4 == 0 else "ok"
            watch.fold(usage_event(model=model, route=model, status=status, queue_ms=5.0, ts=ts))
        # The hung canary: every run reached its engine (total_ms past queue_ms), none answered.
        watch.fold(
            usage_event(
                model="code",
                route="code-v2",
                status=left[i % 4],
                queue_ms=5.0,
                total_ms=900.0,
                ts=ts,
            )
        )
        # A healthy canary whose sessions typed fast: dropped before they ran (total_ms is
        # queue_ms), which says nothing of its route; what it ran, it answered.
        status = "ok" if i % 3 == 0 else "superseded"
        total = 25.0 if status == "ok" else 5.0
        watch.fold(
            usage_event(
                model="chat", route="chat-v2", status=status, queue_ms=5.0, total_ms=total, ts=ts
            )
        )
    now = began + 2
    changes = {c.model: c for c in await watch.evaluate()}
    assert changes["code"].status == "rolled_back", changes
    assert "100.0% of 100 runs abandoned" in changes["code"].reason
    assert changes["chat"].status == "promoted", changes


async def _completion_traffic(
    watch: CanaryWatch, began: float, seconds: range, *, superseded: int = 17
) -> None:
    """A model at 10 runs a second, ``superseded`` of every 20 superseded by the next
    keystroke after they started; one run in ten (a second) on the canary, as a 1 % step's
    sessions are a few of many."""
    for second in seconds:
        for i in range(10):
            ts = began + second + i / 10
            route = "code-v2" if i == 0 and second % 10 == 0 else "code"
            n = second // 10 if route == "code-v2" else second * 10 + i
            status = "superseded" if n % 20 < superseded else "ok"
            watch.fold(
                usage_event(
                    model="code",
                    route=route,
                    status=status,
                    queue_ms=5.0,
                    total_ms=400.0 if status == "superseded" else 25.0,
                    ts=ts,
                )
            )


async def test_a_healthy_canary_on_completion_traffic_waits_for_its_answers(
    stack: LiveStack,
) -> None:
    """At 10 runs a second, 85 % superseded after they started, a 1 % step sees ~180 canary
    runs in 30 min and ~27 answered: a step that slow waits for its answers (its sessions
    are few), and is promoted once it has them, not rolled back for "too little traffic"."""
    began, now = 1_000_000.0, 1_000_000.0
    watch, keys = await _watch(stack, lambda: now)  # 60 s windows, 50 requests
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(1, 100), since=began)
    )
    assert await watch.evaluate() == []
    changes = []
    for tick in range(400):  # 4000 s, judged every 10 s
        await _completion_traffic(watch, began, range(tick * 10, tick * 10 + 10))
        now = began + tick * 10 + 10
        changes += await watch.evaluate()
        if changes:
            break
    assert [(c.status, c.weight) for c in changes] == [("promoted", 100)], changes
    assert changes[0].canary is not None
    assert changes[0].canary.requests == 50
    assert now - began > 3000  # 50 answered at 0.015 a second


async def test_a_streams_app_restarted_late_in_a_step_judges_it_on_what_it_sees(
    stack: LiveStack,
) -> None:
    """A streams app (re)started 40 min into a step holds none of its events: it does not
    roll the canary back at its first look, it judges the traffic it sees from then on."""
    now = 1_000_000.0
    began = now - 2400
    watch, keys = await _watch(stack, lambda: now, canary_min_requests=20)
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(5, 100), since=began)
    )
    assert await watch.evaluate() == []
    for i in range(400):
        ts = now + i / 10
        watch.fold(usage_event(model="code", route="code", ts=ts))
        if i % 10 == 0:
            watch.fold(usage_event(model="code", route="code-v2", ts=ts))
    now += 40
    assert [(c.status, c.weight) for c in await watch.evaluate()] == [("promoted", 100)]


async def test_a_full_step_on_completion_traffic_is_promoted(stack: LiveStack) -> None:
    """At a 100 % step the stable route has no runs: the share of runs superseded on the
    canary has nothing to be held to, and is not judged (completion traffic supersedes most
    runs on any route)."""
    began, now = 1_000_000.0, 1_000_000.0
    watch, keys = await _watch(stack, lambda: now, canary_window_s=1.0, canary_min_requests=20)
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(100,), since=began)
    )
    assert await watch.evaluate() == []
    for i in range(100):
        status = "superseded" if i % 10 < 7 else "ok"
        watch.fold(
            usage_event(
                model="code",
                route="code-v2",
                status=status,
                queue_ms=5.0,
                total_ms=400.0 if status == "superseded" else 25.0,
                ts=began + i / 100,
            )
        )
    now = began + 2
    (change,) = await watch.evaluate()
    assert (change.status, change.weight) == ("promoted", 100), change
    assert change.canary is not None
    assert change.canary.requests == 30


async def test_a_starved_step_waits_and_holds_a_bounded_number_of_events(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with too little canary traffic waits for it (its sessions are few); meanwhile a
    busy stable route's events are kept up to a bound, and both sides are judged on the
    trailing span the stable side still holds."""
    monkeypatch.setattr("streams.canary._MAX_EVENTS", 1000)
    began, now = 1_000_000.0, 1_000_000.0
    watch, keys = await _watch(stack, lambda: now, canary_window_s=1.0, canary_min_requests=20)
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(1, 100), since=began)
    )
    assert await watch.evaluate() == []
    changes = []
    held = []
    for second in range(45):
        for i in range(100):
            watch.fold(usage_event(model="code", route="code", ts=began + second + i / 100))
        if second % 10 == 0:
            watch.fold(usage_event(model="code", route="code-v2", ts=began + second))
        now = began + second + 1
        changes += await watch.evaluate()
        held.append(watch.held("code"))
    assert changes == []  # 5 canary runs: it waits
    assert max(held) <= 1000 + 5, max(held)
    await abort_canary(stack.redis, keys, "code")
    assert await watch.evaluate() == []
    assert watch.held("code") == 0  # nothing kept once the canary no longer runs


async def test_a_put_to_an_action_path_is_refused_not_taken_as_a_model(stack: LiveStack) -> None:
    """The admin routes take the model as the rest of the path, so ``PUT .../x/abort`` would
    start a canary of a model ``x/abort``: it is refused, naming the method that aborts."""
    ingress = await stack.start_ingress(admin_key=ADMIN, models=["laneway-code", "abort"])
    admin = stack.http(ingress, ADMIN)
    for path, body in [
        ("/admin/canary/laneway-code/abort", {"target": "laneway-code-v2"}),
        ("/admin/canary/org/m/abort", {"target": "org/m-v2"}),
        ("/admin/shadow/laneway-code/stop", {"target": "v2", "share": 0.1}),
    ]:
        refused = await admin.put(path, json=body)
        assert refused.status_code == 400, (path, refused.text)
        error = refused.json()["error"]
        assert f"POST {path}" in error["message"], error
        assert error["param"] == "model", error
    assert (await admin.get("/admin/canary")).json()["data"] == []
    assert (await admin.get("/admin/shadow")).json()["data"] == []
    # The lists answer with a trailing slash too; a PUT without a model names it.
    for path in ("/admin/canary/", "/admin/shadow/"):
        listed = await admin.get(path, follow_redirects=True)
        assert (listed.status_code, listed.json()["data"]) == (200, []), (path, listed.text)
    nameless = await admin.put("/admin/canary/", json={"target": "v2"})
    assert nameless.status_code == 400, nameless.text
    assert nameless.json()["error"]["param"] == "model"
    # A model that merely has the word in its name is a model.
    named = await admin.put("/admin/canary/abort", json={"target": "abort-v2"})
    assert (named.status_code, named.json()["model"]) == (201, "abort"), named.text


async def test_a_canary_whose_engine_refuses_what_the_stable_route_serves_is_rolled_back(
    stack: LiveStack,
) -> None:
    """An IDE's ``suffix`` that the canary's engine refuses (usage status ``unsupported``)
    fails its users as an error would: the step is rolled back, not promoted."""
    began, now = 1_000_000.0, 1_000_000.0
    watch, keys = await _watch(stack, lambda: now, canary_window_s=1.0, canary_min_requests=20)
    await put_canary(
        stack.redis, keys, CanaryState(model="code", target="code-v2", steps=(50, 100), since=began)
    )
    assert await watch.evaluate() == []
    for i in range(100):
        route = "code-v2" if i % 2 else "code"
        status = "unsupported" if route == "code-v2" and i % 4 == 1 else "ok"
        watch.fold(usage_event(model="code", route=route, status=status, ts=began + i / 100))
    now = began + 2
    (change,) = await watch.evaluate()
    assert change.status == "rolled_back", change
