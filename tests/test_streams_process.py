"""``python -m streams`` as a subprocess: the helper the other streams tests use, and its own
contract (starts against the real broker, stops cleanly on SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from prometheus_client.parser import text_string_to_metric_families

from laneway.clients import make_admin
from laneway.schema import UsageEvent
from laneway.settings import CommonSettings
from streams.app import TABLES
from streams.changelogs import CHANGELOG_CONFIGS
from tests.stack import PARTITIONS, LiveStack, eventually, free_port

ROOT = Path(__file__).resolve().parent.parent

# Fast timers so tests see decisions within a second; everything else as in production.
FAST: dict[str, Any] = {
    "breaker_eval_interval_s": 0.1,
    "rollup_flush_interval_s": 0.2,
    "quota_factor_interval_s": 0.3,
    "streams_commit_interval_s": 0.2,
}


class StreamsProcess:
    """One ``python -m streams`` child with the stack's prefixes and a data dir of its own."""

    def __init__(
        self, stack: LiveStack, data_dir: Path, *, module: str = "streams", **settings: Any
    ) -> None:
        self.module = module
        env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
        values: dict[str, Any] = {
            **stack.common,
            "streams_data_dir": str(data_dir),
            "log_level": "INFO",
            **FAST,
            **settings,
        }
        for name, value in values.items():
            text = value if isinstance(value, str) else orjson.dumps(value).decode()
            env[f"LANEWAY_{name.upper()}"] = text
        env["PYTHONPATH"] = str(ROOT)
        self.env = env
        self.log_path = data_dir / "streams.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, env=self.env, cwd=ROOT, stdout=log, stderr=log
            )

    async def stop(self, sig: int = signal.SIGTERM, within_s: float = 30.0) -> int:
        """Signal the child and wait for it; returns its exit code."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.returncode is None:
            proc.send_signal(sig)
        try:
            return await asyncio.wait_for(proc.wait(), within_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def usage_event(**fields: Any) -> UsageEvent:
    values: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "team": "team-a",
        "cls": "completion",
        "model": "laneway-code",
        "route": "laneway-code",
        "status": "ok",
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "total_ms": 25.0,
        "ts": time.time(),
    }
    values.update(fields)
    return UsageEvent(**values)


async def produce_usage(producer: AIOKafkaProducer, topic: str, events: list[UsageEvent]) -> None:
    """Keyed by team, as the workers do; waits until the broker has all of them."""
    futures = [await producer.send(topic, e.to_json(), key=e.team.encode()) for e in events]
    await asyncio.gather(*futures)


async def test_streams_process_starts_and_stops_cleanly_on_sigterm(
    stack: LiveStack, tmp_path: Path
) -> None:
    port = free_port()
    streams = StreamsProcess(
        stack, tmp_path, rollup_idle_s=0.5, rollup_grace_s=0, metrics_port=str(port)
    )
    await streams.start()
    try:
        producer = await stack.producer()
        event = usage_event(ts=time.time() - 7200)
        await produce_usage(producer, stack.topics.usage, [event])
        await producer.send_and_wait(stack.topics.usage, b"not json", key=b"team-a")
        records = await stack.read_topic(stack.topics.usage_hourly, count=1, within_s=30)
        assert records[0]["team"] == "team-a"
        assert records[0]["requests"] == 1
        async with httpx.AsyncClient() as http:
            scrape = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(scrape)
            for sample in family.samples
        }
        assert samples[("laneway_streams_events_total", (("result", "folded"),))] >= 1
        assert samples[("laneway_streams_events_total", (("result", "malformed"),))] >= 1
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()
    assert "skipping usage record" in streams.log()


async def test_changelog_partitions_unlike_the_usage_topics_are_refused_naming_the_setting(
    stack: LiveStack, tmp_path: Path
) -> None:
    """The tables are partitioned as the topic they fold: another count only timed out
    waiting for changelogs, in a crash loop that named no setting."""
    streams = StreamsProcess(stack, tmp_path, streams_partitions=PARTITIONS + 1)
    await streams.start()
    assert streams.proc is not None
    assert await asyncio.wait_for(streams.proc.wait(), 60) == 2, streams.log()
    assert f"LANEWAY_STREAMS_PARTITIONS={PARTITIONS + 1}, but" in streams.log()


async def test_a_sigterm_while_the_tables_recover_stops_the_process_cleanly(
    stack: LiveStack, tmp_path: Path
) -> None:
    """The entry point watches for signals while the app starts, which lasts as long as
    table recovery: a SIGTERM then stops it (exit 0, nothing left unretrieved), as it does
    once the app runs."""
    streams = StreamsProcess(stack, tmp_path / "data")
    await streams.start()
    try:
        await eventually(lambda: "partitions assigned" in streams.log(), 30, "an assignment")
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()
    for said in ("Traceback", "never retrieved", "was never awaited"):
        assert said not in streams.log(), streams.log()


@pytest.mark.parametrize("after_s", [0.2, 0.8])
async def test_a_sigterm_in_the_first_second_stops_the_process_cleanly(
    stack: LiveStack, tmp_path: Path, after_s: float
) -> None:
    """``laneway up`` and operators stop the app with SIGTERM whenever they need to: one that
    comes while it still imports Faust, reads the topics or makes its changelogs stops it
    cleanly too (exit 0, as once it runs), not killed by the signal (-15); and its changelogs
    are made whole or not at all."""
    streams = StreamsProcess(stack, tmp_path)
    await streams.start()
    assert streams.proc is not None
    # Counted from the interpreter's own start: no handler can come before it (some 50 ms,
    # more on a busy machine), and Faust's imports take about a second after it.
    await eventually(lambda: _python_started(streams), 30, "the interpreter to start")
    assert await _exits(streams, within_s=after_s) is None, streams.log()  # still starting
    code = await streams.stop(within_s=30)
    assert code == 0, streams.log()
    for said in ("Traceback", "never retrieved", "was never awaited"):
        assert said not in streams.log(), streams.log()
    names = [f"{stack.prefix}-streams-{table}-changelog" for table in TABLES]
    admin = make_admin(CommonSettings(**stack.common))
    await admin.start()
    try:
        made = [t for t in await admin.describe_topics(names) if not t["error_code"]]
    finally:
        await admin.close()
    assert {t["topic"] for t in made} in (set(), set(names)), made
    assert all(len(t["partitions"]) == PARTITIONS for t in made), made


def _python_started(streams: StreamsProcess) -> bool:
    """Whether the child's interpreter has started: it ignores SIGPIPE from its start on, and
    its parent (``subprocess``) had it default at the exec."""
    assert streams.proc is not None
    status = Path(f"/proc/{streams.proc.pid}/status").read_text()
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    return bool(ignored & (1 << (signal.SIGPIPE - 1)))


async def _exits(streams: StreamsProcess, within_s: float) -> int | None:
    """The child's exit code once it exits by itself within ``within_s``; None if it runs on."""
    proc = streams.proc
    assert proc is not None
    try:
        return await asyncio.wait_for(proc.wait(), within_s)
    except TimeoutError:
        return None


def _faulty_runs(
    stack: LiveStack, tmp_path: Path, fault: str
) -> tuple[StreamsProcess, StreamsProcess]:
    """A run of the entry point with ``fault`` planted (tests/streams_fault.py) and its
    restart: one data dir, one marker (a fault met once is not met again)."""
    settings: dict[str, Any] = {"rollup_idle_s": 0.5, "rollup_grace_s": 0}
    runs = [
        StreamsProcess(stack, tmp_path / "data", module="tests.streams_fault", **settings)
        for _ in range(2)
    ]
    for run in runs:
        run.env["STREAMS_FAULT"] = fault
        run.env["STREAMS_FAULT_MARKER"] = str(tmp_path / "fault-met")
    return runs[0], runs[1]


async def _exit_code(run: StreamsProcess) -> int | None:
    """Start ``run``; its exit code once it exits by itself within 60 s (None: it ran on)."""
    await run.start()
    try:
        return await _exits(run, within_s=60)
    finally:
        await run.stop()


async def _requests_by_team(stack: LiveStack) -> dict[str, int]:
    """Each team's requests in its hour's latest revision on the hourly topic."""
    latest: dict[str, dict[str, Any]] = {}
    for record in await stack.read_all(stack.topics.usage_hourly):
        team = record["team"]
        if team not in latest or record["revision"] > latest[team]["revision"]:
            latest[team] = record
    return {team: r["requests"] for team, r in latest.items()}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["once", "always"])
async def test_a_record_that_fails_to_fold_restarts_the_app_then_is_skipped_if_it_fails_again(
    stack: LiveStack, tmp_path: Path, fault: str
) -> None:
    """A bug that raises while folding a valid record (tests/streams_fault.py plants one)
    ends the process with an error naming the record, instead of leaving it up with nothing
    folded or going on past the record unsaid. The restart (same data dir) reads it again:
    counted once if the fault has passed; if records fail again, each is skipped with an
    error (one restart, not one a record), so the records after them are counted and the
    process stays up either way."""
    teams = {"team-a": 5, "team-fault": 2, "team-b": 5}  # two records the bug fails on
    events = [
        usage_event(team=team, ts=time.time() - 7200)
        for team, count in teams.items()
        for _ in range(count)
    ]
    producer = await stack.producer()
    await produce_usage(producer, stack.topics.usage, events)
    first, second = _faulty_runs(stack, tmp_path, fault)
    assert await _exit_code(first) == 1, first.log()
    assert "was not folded: RuntimeError('a planted bug')" in first.log()
    assert f"usage record {stack.topics.usage}:" in first.log()

    await second.start()
    try:
        await stack.read_topic(
            stack.topics.usage_hourly,
            count=2,
            within_s=60,
            where=lambda r: r["team"] != "team-fault",
        )
        if fault == "once":
            await stack.read_topic(
                stack.topics.usage_hourly,
                count=1,
                within_s=60,
                where=lambda r: r["team"] == "team-fault",
            )
        await asyncio.sleep(2)  # any hour published late, or twice
        counted = await _requests_by_team(stack)
        assert await _exits(second, within_s=0.1) is None, second.log()  # still up
    finally:
        print(second.log())  # both runs' (one data dir): pytest shows it if the test fails
        assert await second.stop() == 0, second.log()
    if fault == "always":
        del teams["team-fault"]
        assert second.log().count("in the run a failure restarted; skipped") == 2
    assert counted == teams, second.log()


@pytest.mark.slow
@pytest.mark.parametrize("step", ["flush", "perform_seek"])
async def test_a_table_recovery_step_that_times_out_ends_the_process_for_a_restart(
    stack: LiveStack, tmp_path: Path, step: str
) -> None:
    """Faust takes a recovery step that outlasts ``broker_request_timeout`` for the service
    stopping: its recovery ends for good with the flow off, said only at DEBUG, and the
    process stays up folding nothing. It now exits 1 saying so, and the restart counts
    everything (tests/streams_fault.py plants the timeout)."""
    teams = {"team-a": 4, "team-b": 3}
    events = [
        usage_event(team=team, ts=time.time() - 7200)
        for team, count in teams.items()
        for _ in range(count)
    ]
    await produce_usage(await stack.producer(), stack.topics.usage, events)
    first, second = _faulty_runs(stack, tmp_path, f"recovery:{step}")
    assert await _exit_code(first) == 1, first.log()
    assert "a step of table recovery took more than 90.0 s" in first.log()  # its bound
    assert not await stack.read_all(stack.topics.usage_hourly)  # it folded nothing

    async def counted() -> dict[str, int]:
        found = await _requests_by_team(stack)
        return found if found == teams else {}

    await second.start()
    try:
        await eventually(counted, 60, "every event counted by the restart")
    finally:
        assert await second.stop() == 0, second.log()


async def test_usage_rolls_up_while_redis_does_not_answer(stack: LiveStack, tmp_path: Path) -> None:
    """Rollups go to Kafka alone: a Redis that does not answer holds up the breaker levels
    (which a restart takes over from it), not the hourly usage analysts and billing read."""
    streams = StreamsProcess(
        stack,
        tmp_path,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        rollup_idle_s=0.5,
        rollup_grace_s=0,
    )
    await streams.start()
    try:
        producer = await stack.producer()
        events = [usage_event(ts=time.time() - 7200, completion_tokens=10 + i) for i in range(3)]
        await produce_usage(producer, stack.topics.usage, events)
        records = await stack.read_topic(
            stack.topics.usage_hourly,
            count=1,
            within_s=30,
            where=lambda r: r["final"] and r["requests"] == 3,
        )
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()
    assert records[0]["completion_tokens"] == 33, records


async def test_the_changelogs_are_kept_compact_made_now_or_before(
    stack: LiveStack, tmp_path: Path
) -> None:
    """A start replays the changelogs whole before it folds anything: with Kafka's defaults
    (1 GiB segments, tombstones kept a day) every write of days stayed and was read first.
    A changelog made by an older laneway is set as a new one is, keeping what an operator
    set on it."""
    app_id = f"{stack.prefix}-streams"
    old = f"{app_id}-{TABLES[0]}-changelog"
    admin = make_admin(CommonSettings(**stack.common))
    await admin.start()
    try:
        # An older laneway's changelog, with a setting an operator made on it.
        operators = {"cleanup.policy": "compact", "max.message.bytes": "2000000"}
        await admin.create_topics([NewTopic(old, PARTITIONS, 1, topic_configs=operators)])
        streams = StreamsProcess(stack, tmp_path)
        await streams.start()
        try:
            await eventually(lambda: "partitions assigned" in streams.log(), 60, "a start")
        finally:
            assert await streams.stop() == 0, streams.log()
        names = [f"{app_id}-{table}-changelog" for table in TABLES]
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
        )
    finally:
        await admin.close()
    resources = [r for response in described for r in response.to_object()["resources"]]
    assert sorted(r["resource_name"] for r in resources) == sorted(names)
    for resource in resources:
        config = {e["config_names"]: e["config_value"] for e in resource["config_entries"]}
        kept = {name: config[name] for name in CHANGELOG_CONFIGS}
        assert kept == CHANGELOG_CONFIGS, resource["resource_name"]
        if resource["resource_name"] == old:  # what the operator set stays
            assert config["max.message.bytes"] == "2000000"
