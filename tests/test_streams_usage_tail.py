"""``laneway usage tail``: follows either topic, filters by team, prints a table or JSON lines."""

from __future__ import annotations

import argparse
import io
import json
import time
import uuid

from aiokafka import AIOKafkaProducer

from laneway.settings import CommonSettings
from streams.usage_tail import add_usage_commands, tail_usage
from tests.stack import LiveStack
from tests.test_streams_process import produce_usage, usage_event


async def test_tail_filters_by_team_as_json_and_table(stack: LiveStack) -> None:
    producer = await stack.producer()
    # Ahead of team a's events on their partition: the tail reads past it to them.
    await producer.send_and_wait(stack.topics.usage, b"garbage", key=b"a")
    events = [usage_event(team=team, ts=time.time()) for team in ("a", "b", "a", "c", "a")]
    events.append(usage_event(team="d", status="cancelled", shadow=True))
    await produce_usage(producer, stack.topics.usage, events)
    settings = CommonSettings(**stack.common)

    out = io.StringIO()
    shown = await tail_usage(
        settings, team="a", output="json", from_beginning=True, limit=3, out=out
    )
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert shown == 3
    assert {line["team"] for line in lines} == {"a"}
    assert {line["id"] for line in lines} == {e.id for e in events if e.team == "a"}

    table = io.StringIO()
    await tail_usage(settings, team="b", from_beginning=True, limit=1, out=table)
    header, row = table.getvalue().splitlines()
    assert header.split() == [
        *("ts", "team", "class", "model", "route", "status", "prompt", "output", "total_ms")
    ]  # every header whole in its column
    assert row.split()[1:4] == ["b", "completion", "laneway-code"]
    # A shadow copy's event says so: it is not billed, and its status is the mirror's.
    table = io.StringIO()
    await tail_usage(settings, team="d", from_beginning=True, limit=1, out=table)
    assert table.getvalue().splitlines()[1].split()[5:7] == ["shadow", "cancelled"]


async def test_tail_follows_hourly_rollups(stack: LiveStack) -> None:
    producer = await stack.producer()
    record = {
        "team": "a",
        "class": "chat",
        "model": "m",
        "hour": "2026-01-01T10:00:00Z",
        "requests": 7,
        "errors": 1,
        "latency_ms": {"p99": 12.5},
        "cost": 0.25,
    }
    await producer.send_and_wait(stack.topics.usage_hourly, json.dumps(record).encode(), key=b"a")
    out = io.StringIO()
    await tail_usage(
        CommonSettings(**stack.common), hourly=True, from_beginning=True, limit=1, out=out
    )
    row = out.getvalue().splitlines()[1].split()
    assert row[:5] == ["2026-01-01T10:00:00Z", "a", "chat", "m", "7"]
    assert row[-3:] == ["12.5", "0.250000", "final"]


async def test_tail_redraws_the_open_hour_in_place(stack: LiveStack) -> None:
    producer = await stack.producer()

    def record(hour: str, requests: int, revision: int, *, final: bool) -> bytes:
        fields = {"team": "a", "class": "completion", "model": "m", "hour": hour}
        values = {"requests": requests, "revision": revision, "final": final}
        return json.dumps({**fields, **values}).encode()

    for value in (
        record("2026-01-01T09:00:00Z", 4, 5, final=True),
        record("2026-01-01T10:00:00Z", 2, 2, final=False),
        record("2026-01-01T10:00:00Z", 6, 6, final=False),
    ):
        await producer.send_and_wait(stack.topics.usage_hourly, value, key=b"a")
    out = io.StringIO()
    shown = await tail_usage(
        CommonSettings(**stack.common),
        hourly=True,
        from_beginning=True,
        limit=3,
        out=out,
        redraw=True,
    )
    assert shown == 3
    frames = out.getvalue().split("\x1b[H\x1b[2J")
    header, *rows = frames[-1].splitlines()
    assert header.split()[0] == "hour"
    assert [(r.split()[0], r.split()[4], " ".join(r.split()[-2:])) for r in rows] == [
        ("2026-01-01T09:00:00Z", "4", "final r5"),
        ("2026-01-01T10:00:00Z", "6", "open r6"),
    ]


async def test_tail_skips_aborted_usage_and_odd_latency(stack: LiveStack) -> None:
    """A batch line whose transaction aborted runs again: its first usage is not shown (it
    would be counted twice by whoever reads the tail). A record's odd ``latency_ms`` is
    shown as nothing, not a crash."""
    txn = AIOKafkaProducer(
        bootstrap_servers=stack.services.bootstrap,
        transactional_id=f"{stack.prefix}-tail-{uuid.uuid4().hex[:6]}",
        **stack.services.admin_auth,
    )
    await txn.start()
    try:
        aborted = usage_event(team="txn", cls="batch", completion_tokens=64)
        await txn.begin_transaction()
        await txn.send_and_wait(stack.topics.usage, aborted.to_json(), key=b"txn")
        await txn.abort_transaction()
        kept = usage_event(team="txn", cls="batch", completion_tokens=3)
        async with txn.transaction():
            await txn.send(stack.topics.usage, kept.to_json(), key=b"txn")
    finally:
        await txn.stop()
    odd = json.dumps({**json.loads(usage_event(team="txn").to_json()), "latency_ms": 5})
    producer = await stack.producer()
    await producer.send_and_wait(stack.topics.usage, odd.encode(), key=b"txn")
    settings = CommonSettings(**stack.common)

    out = io.StringIO()
    await tail_usage(settings, team="txn", output="json", from_beginning=True, limit=2, out=out)
    shown = [json.loads(line) for line in out.getvalue().splitlines()]
    assert aborted.id not in {line["id"] for line in shown}
    assert shown[0]["id"] == kept.id

    table = io.StringIO()
    await tail_usage(settings, team="txn", from_beginning=True, limit=2, out=table)
    assert len(table.getvalue().splitlines()) == 3  # the header and both records


def test_cli_registers_usage_tail() -> None:
    parser = argparse.ArgumentParser(prog="laneway")
    add_usage_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["usage", "tail", "--hourly", "--team", "x", "-o", "json"])
    assert (args.hourly, args.team, args.output, args.limit) == (True, "x", "json", None)
    assert callable(args.func)


async def test_tail_tells_teams_apart_whose_names_differ_past_the_column(stack: LiveStack) -> None:
    """A name longer than its column keeps its start and its end: two regions of one team
    name, cut at the end, read as one team."""
    producer = await stack.producer()
    teams = ("payments-eu-west-1", "payments-eu-west-2")
    await produce_usage(
        producer, stack.topics.usage, [usage_event(team=t, ts=time.time()) for t in teams]
    )
    shown = set()
    for team in teams:
        out = io.StringIO()
        await tail_usage(
            CommonSettings(**stack.common), team=team, from_beginning=True, limit=1, out=out
        )
        shown.add(out.getvalue().splitlines()[1].split()[1])
    assert shown == {"payme…west-1", "payme…west-2"}
