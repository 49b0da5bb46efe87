"""Metrics, heartbeats, health probes and the cost report, on the real broker and Redis."""

from __future__ import annotations

import time

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from laneway import metrics as shared_metrics
from laneway.settings import CommonSettings
from streams.records import HourlyRollup, LatencySummary
from streams.report import CostRow, cost_report, render
from tests.stack import LiveStack, eventually, free_port


def _families(text: str) -> dict[str, set[frozenset[str]]]:
    """Metric name → the label-name sets of its samples (parsing fails on a bad scrape)."""
    out: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).add(frozenset(sample.labels))
    return out


def _sample(scrape: httpx.Response, name: str, **labels: str) -> float:
    """The value of one sample of a scrape; 0 when it is not there yet."""
    for family in text_string_to_metric_families(scrape.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def test_ingress_scrape_carries_team_class_model(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    http = stack.http(ingress, await stack.api_key("metrics-team"))
    for streamed in (False, True):
        body = {"model": "laneway-code", "prompt": "x = 1", "max_tokens": 8, "stream": streamed}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200
    before = await http.get("/metrics")
    errors_before = _sample(before, "laneway_errors_total", kind="bad_request")
    responses = "laneway_ingress_responses_total"
    counted_before = [
        _sample(before, responses, cls="completion", code=code) for code in ("200", "404")
    ]
    assert (
        await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    ).status_code == 404
    scrape = await http.get("/metrics")
    # Every answer is counted by its status, an error too (they were not).
    assert [_sample(scrape, responses, cls="completion", code=c) for c in ("200", "404")] == [
        counted_before[0],
        counted_before[1] + 1,
    ]
    text = scrape.text
    families = _families(text)
    assert (
        frozenset({"team", "cls", "model", "le"})
        in families["laneway_ingress_latency_seconds_bucket"]
    )
    assert frozenset({"team", "cls", "model", "kind"}) in families["laneway_tokens_total"]
    assert frozenset({"team", "cls", "model"}) in families["laneway_cost_total"]
    assert (
        frozenset({"team", "cls", "model", "le"}) in families["laneway_queue_wait_seconds_bucket"]
    )
    assert frozenset({"team", "cls", "model", "le"}) in families["laneway_ttft_seconds_bucket"]
    assert frozenset({"kind"}) in families["laneway_errors_total"]
    # Counted once: the registry is the process's, so other tests' errors are in it too.
    assert _sample(scrape, "laneway_errors_total", kind="bad_request") == errors_before + 1
    labels = 'cls="completion",model="laneway-code",team="metrics-team"'
    assert f"laneway_ingress_latency_seconds_count{{{labels}}} 2.0" in text


def test_team_labels_stay_bounded() -> None:
    seen = {
        shared_metrics.team_label(f"flood-{i}") for i in range(shared_metrics.MAX_TEAM_LABELS + 50)
    }
    assert "other" in seen
    assert len(seen) <= shared_metrics.MAX_TEAM_LABELS + 1


async def test_worker_process_scrape_and_heartbeat(stack: LiveStack) -> None:
    port = free_port()
    proc = stack.spawn(
        "workers",
        LANEWAY_POOL="chat",
        LANEWAY_WORKER_ID="scraped",
        LANEWAY_ENGINE="sim",
        LANEWAY_METRICS_PORT=str(port),
        LANEWAY_HEARTBEAT_INTERVAL_S="0.5",
    )
    try:
        info_key = f"{stack.prefix}:worker:scraped"
        await eventually(lambda: stack.redis.exists(info_key), 30, "the worker's heartbeat record")
        info = orjson.loads(await stack.redis.get(info_key))
        assert info["engine"] == "sim"
        assert info["simulation"] is True
        assert len(info["model_digest"]) == 16
        assert {"backlog", "kv_cache_usage", "prefix_cache_hit_rate", "memory_free_bytes"} <= set(
            info
        )
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        families = _families(text)
        assert frozenset({"pool", "topic"}) in families["laneway_consumer_lag"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def test_prober_notices_a_stopped_pool_and_its_return(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(
        probe_interval_s=0.5, probe_timeout_s=3.0, admin_key="ops-secret-0123456"
    )
    workers = {pool: await stack.start_worker(pool) for pool in ("completion", "chat", "batch")}
    http = stack.http(ingress, "ops-secret-0123456")  # the checks are for the operator

    async def ready() -> tuple[int, dict[str, dict[str, object]]]:
        response = await http.get("/readyz")
        return response.status_code, response.json()["checks"]

    await eventually(
        lambda: ingress.state.prober.results.get("batch") is not None, 20, "a batch probe"
    )

    async def is_ready() -> bool:
        return (await ready())[0] == 200

    await eventually(is_ready, 20, "the ingress ready with every pool probed")

    async def completion_probe_failed() -> tuple[int, dict[str, dict[str, object]]] | None:
        status, checks = await ready()
        return (status, checks) if checks.get("probe.completion", {}).get("ok") is False else None

    await workers["completion"].stop()
    status, _ = await eventually(completion_probe_failed, 10, "the completion probe to fail")
    assert status == 503

    async def chat_probe_ok_meanwhile() -> bool:
        checks = (await ready())[1]
        return checks["probe.completion"]["ok"] is False and checks["probe.chat"]["ok"] is True

    # The other pools' probes still pass (the next one, if a slow broker made one time out).
    await eventually(chat_probe_ok_meanwhile, 10, "the chat probe to pass while completion's fail")

    await stack.start_worker("completion")
    await eventually(is_ready, 20, "the ingress ready again")

    # The batch pool stopped: its probe fails, yet the ingress stays ready (batch lines wait
    # on Kafka; taking ingresses out of rotation would stop every team's completions).
    async def batch_probe_failed() -> tuple[int, dict[str, dict[str, object]]] | None:
        status, checks = await ready()
        return (status, checks) if checks.get("probe.batch", {}).get("ok") is False else None

    await workers["batch"].stop()
    status, checks = await eventually(batch_probe_failed, 20, "the batch probe to fail")
    assert (status, checks["probe.batch"].get("degraded")) == (200, True)
    control = await stack.read_topic(
        stack.topics.control, count=6, where=lambda r: r.get("kind") == "probe"
    )
    assert {r["pool"] for r in control} >= {"completion", "chat", "batch"}


def _rollup(
    team: str,
    cls: str,
    hour_start: int,
    revision: int,
    tokens: int,
    cost: float,
    *,
    final: bool = True,
) -> HourlyRollup:
    return HourlyRollup(
        team=team,
        cls=cls,
        model="laneway-code",
        hour=time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(hour_start)),
        hour_start=hour_start,
        requests=revision,
        ok=revision,
        errors=0,
        dropped=0,
        statuses={"ok": revision},
        routes={"laneway-code": revision},
        prompt_tokens=tokens,
        cached_tokens=0,
        completion_tokens=tokens // 2,
        engine_ms=1.0,
        latency_ms=LatencySummary(),
        cost=cost,
        revision=revision,
        final=final,
    )


async def test_cost_report_matches_a_known_history(stack: LiveStack) -> None:
    now = time.time()
    hour = int(now // 3600) * 3600
    history = [
        _rollup("alpha", "completion", hour - 3 * 3600, 5, 1000, 1.0),
        _rollup("alpha", "completion", hour - 3 * 3600, 9, 1800, 1.8),  # later revision wins
        _rollup("alpha", "completion", hour - 2 * 3600, 4, 400, 0.4),
        _rollup("beta", "chat", hour - 3600, 2, 200, 0.25),
        _rollup("beta", "chat", hour - 30 * 3600, 7, 7000, 7.0),  # outside --since 24h
        # The open hour: provisional records only, left out unless asked for.
        _rollup("beta", "chat", hour, 3, 300, 0.5, final=False),
        _rollup("beta", "chat", hour, 6, 600, 1.0, final=False),
    ]
    producer = await stack.producer()
    for rollup in history:
        await producer.send_and_wait(
            stack.topics.usage_hourly,
            rollup.model_dump_json(by_alias=True).encode(),
            key=rollup.team.encode(),
        )
    settings = CommonSettings(**stack.common)
    rows = await cost_report(settings, 24 * 3600, now=now)
    summary = {
        (r.team, r.cls): (r.requests, r.prompt_tokens, r.completion_tokens, r.cost) for r in rows
    }
    assert summary == {
        ("alpha", "completion"): (13, 2200, 1100, 2.2),
        ("beta", "chat"): (2, 200, 100, 0.25),
    }
    csv_text = render(rows, "csv")
    assert (
        csv_text.splitlines()[0]
        == "team,cls,model,requests,prompt_tokens,cached_tokens,completion_tokens,cost"
    )
    assert "alpha,completion,laneway-code,13,2200,0,1100,2.2" in csv_text
    assert "total" in render(rows, "table")
    with_open = await cost_report(settings, 24 * 3600, now=now, include_open=True)
    assert {(r.team, r.cls): (r.requests, r.cost) for r in with_open} == {
        ("alpha", "completion"): (13, 2.2),
        ("beta", "chat"): (8, 1.25),
    }


def test_a_team_name_a_spreadsheet_would_run_as_a_formula_is_quoted_in_the_csv() -> None:
    rows = [CostRow(name, "chat", "laneway-chat", 1, 2, 0, 3, 0.5) for name in ("=1+2", "@SUM(1)")]
    lines = render(rows, "csv").splitlines()[1:]
    assert [line.split(",")[0] for line in lines] == ["'=1+2", "'@SUM(1)"]
    assert lines[0].endswith(",1,2,0,3,0.5")  # numbers stay numbers
