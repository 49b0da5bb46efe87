"""``laneway report cost``: tokens and cost per team / class / model from the hourly rollups."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import re
import sys
import time
from dataclasses import dataclass, fields

import orjson
from aiokafka import TopicPartition
from pydantic import ValidationError

from laneway.clients import make_consumer, start_client, topic_partitions
from laneway.errors import ConfigError
from laneway.settings import CommonSettings, load_settings
from streams.records import HourlyRollup

__all__ = ["CostRow", "add_report_commands", "cost_report", "parse_duration"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True, slots=True)
class CostRow:
    team: str
    cls: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if match is None:
        raise ConfigError(f"--since {text!r}: use a number and a unit, e.g. 7d, 12h, 30m")
    return float(match.group(1)) * _UNITS[match.group(2)]


async def cost_report(
    settings: CommonSettings,
    since_s: float,
    *,
    team: str | None = None,
    now: float | None = None,
    include_open: bool = False,
) -> list[CostRow]:
    """Sum the latest revision of every hourly rollup that starts within ``since_s``: closed
    hours only, unless ``include_open`` (then an open hour counts as its latest provisional
    record has it)."""
    now = time.time() if now is None else now
    start = now - since_s
    latest = await _latest_rollups(settings, start, team)
    totals: dict[tuple[str, str, str], list[float]] = {}
    for (t, c, m, hour_start), rollup in latest.items():
        if hour_start + 3600 <= start or not (rollup.final or include_open):
            continue
        row = totals.setdefault((t, c, m), [0, 0, 0, 0, 0.0])
        row[0] += rollup.requests
        row[1] += rollup.prompt_tokens
        row[2] += rollup.cached_tokens
        row[3] += rollup.completion_tokens
        row[4] += rollup.cost
    return [
        CostRow(t, c, m, int(v[0]), int(v[1]), int(v[2]), int(v[3]), round(v[4], 6))
        for (t, c, m), v in sorted(totals.items())
    ]


async def _latest_rollups(
    settings: CommonSettings, start: float, team: str | None
) -> dict[tuple[str, str, str, int], HourlyRollup]:
    """The highest revision of each (team, class, model, hour) published since ``start``."""
    topic = settings.topics.usage_hourly
    partitions = await topic_partitions(settings, topic)
    if not partitions:
        raise ConfigError(f"topic {topic} does not exist (is LANEWAY_TOPIC_PREFIX right?)")
    consumer = make_consumer(settings, isolation_level="read_committed")
    await start_client(consumer)  # a Ctrl-C during the start leaves no socket open
    latest: dict[tuple[str, str, str, int], HourlyRollup] = {}
    try:
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        # Rollups are published after their hour ends: start an hour before the window.
        since_ms = int(max(0.0, start - 3600) * 1000)  # a window past 1970 is all of it
        found = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            hit = found.get(tp)
            consumer.seek(tp, ends[tp] if hit is None else hit.offset)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    rollup = _rollup(record.value)
                    if rollup is None or (team and rollup.team != team):
                        continue
                    key = (rollup.team, rollup.cls, rollup.model, rollup.hour_start)
                    kept = latest.get(key)
                    if kept is None or rollup.revision >= kept.revision:
                        latest[key] = rollup
    finally:
        await consumer.stop()
    return latest


def _rollup(raw: bytes | None) -> HourlyRollup | None:
    try:
        return HourlyRollup.model_validate(orjson.loads(raw or b""))
    except (orjson.JSONDecodeError, ValidationError):
        return None


def _cell(value: object) -> object:
    """A text cell a spreadsheet would read as a formula (a team named ``=1+2``), quoted."""
    if isinstance(value, str) and value[:1] in _FORMULA_STARTS:
        return "'" + value
    return value


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def render(rows: list[CostRow], fmt: str) -> str:
    names = [f.name for f in fields(CostRow)]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        for row in rows:
            writer.writerow([_cell(getattr(row, n)) for n in names])
        return out.getvalue()
    table = [names] + [
        [f"{getattr(r, n):.4f}" if n == "cost" else str(getattr(r, n)) for n in names] for r in rows
    ]
    if rows:
        total = sum(r.cost for r in rows)
        table.append(
            ["total", "", "", str(sum(r.requests for r in rows)), "", "", "", f"{total:.4f}"]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(names))]
    return (
        "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in table
        )
        + "\n"
    )


def _cmd_cost(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    rows = asyncio.run(
        cost_report(
            settings, parse_duration(args.since), team=args.team, include_open=args.include_open
        )
    )
    sys.stdout.write(render(rows, args.format))
    if not rows and not args.include_open and args.format == "table":
        # Not on stdout: a CSV reader must not see it.
        sys.stderr.write(
            "no closed hour in the window: the hour still open is left out "
            "(--include-open counts it as its latest provisional record has it)\n"
        )
    return 0


def add_report_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    report = sub.add_parser("report", help="reports from the hourly rollups").add_subparsers(
        dest="report_command", required=True
    )
    cost = report.add_parser("cost", help="tokens and cost per team / class / model")
    cost.add_argument("--since", default="7d", help="window, e.g. 7d, 24h (default 7d)")
    cost.add_argument("--team", default=None)
    cost.add_argument("--format", choices=["table", "csv"], default="table")
    cost.add_argument(
        "--include-open",
        action="store_true",
        help="count hours still open too, as their latest provisional record has them",
    )
    cost.set_defaults(func=_cmd_cost)
