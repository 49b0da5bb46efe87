"""``laneway usage tail``: follow ``laneway.usage`` or ``laneway.usage.hourly`` as a table or
JSON lines, optionally for one team.

On a terminal the hourly table is redrawn in place: one line per (team, class, model, hour),
its latest revision, so the open hour's line moves as its provisional records arrive.
Elsewhere (a pipe, a file) every record is a line of its own."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import orjson
from aiokafka import AIOKafkaConsumer

from laneway.arguments import int_from
from laneway.clients import kafka_auth
from laneway.settings import CommonSettings, load_settings

__all__ = ["add_usage_commands", "tail_usage"]

_USAGE_COLUMNS = (
    ("ts", 8), ("team", 12), ("class", 10), ("model", 14), ("route", 18), ("status", 17),
    ("prompt_tokens", 7), ("completion_tokens", 7), ("total_ms", 8),
)  # fmt: skip
_HOURLY_COLUMNS = (
    ("hour", 20), ("team", 12), ("class", 10), ("model", 14), ("requests", 8), ("errors", 6),
    ("prompt_tokens", 9), ("completion_tokens", 9), ("p99_ms", 8), ("cost", 10),
    ("state", 12),
)  # fmt: skip
# Headers that fit their columns (a cut "prompt_" / "complet" read as nothing).
_LABELS = {"prompt_tokens": "prompt", "completion_tokens": "output"}
# Home the cursor and clear the screen (ANSI; every terminal laneway runs in takes it).
_CLEAR = "\x1b[H\x1b[2J"
_MAX_DRAWN_ROWS = 200
_KEY_FIELDS = ("hour", "team", "class", "model")
_COST_DECIMALS_BELOW = 100.0  # costs under this show to the millionth, as the rollups keep them


def _cell(record: dict[str, Any], name: str) -> str:
    if name == "state":
        state = "final" if record.get("final", True) else "open"
        revision = record.get("revision")
        return f"{state} r{revision}" if isinstance(revision, int) else state
    if name == "status" and record.get("shadow"):  # a mirror, not billed (docs/shadow.md)
        return f"shadow {record.get('status')}"
    if name == "ts":
        try:
            return time.strftime("%H:%M:%S", time.localtime(float(record.get("ts", 0))))
        except (TypeError, ValueError, OverflowError, OSError):  # a record's own odd time
            return str(record.get("ts"))[:8]
    if name == "p99_ms":
        latency = record.get("latency_ms")
        value = latency.get("p99") if isinstance(latency, dict) else None
    else:
        value = record.get(name)
    if isinstance(value, float):
        return _number(name, value)
    return "-" if value is None else str(value)


def _number(name: str, value: float) -> str:
    if name == "cost":  # a small team's hour is fractions of a cent
        return f"{value:.6f}" if value < _COST_DECIMALS_BELOW else f"{value:.2f}"
    return f"{value:.1f}"


def _header(columns: tuple[tuple[str, int], ...]) -> str:
    return _row(columns, [_LABELS.get(name, name) for name, _ in columns])


def _row(columns: tuple[tuple[str, int], ...], values: list[str]) -> str:
    return " ".join(_fit(v, w).ljust(w) for (_, w), v in zip(columns, values, strict=True)).rstrip()


def _fit(value: str, width: int) -> str:
    """``value`` in ``width`` characters: a longer one keeps its start and its end around a
    "…" (team-eu-west-1 and team-eu-west-2 cut at the end would read as one team)."""
    if len(value) <= width:
        return value
    head = (width - 1) // 2
    return value[:head] + "…" + value[len(value) - (width - 1 - head) :]


async def tail_usage(
    settings: CommonSettings,
    *,
    hourly: bool = False,
    team: str | None = None,
    output: str = "table",
    from_beginning: bool = False,
    limit: int | None = None,
    out: TextIO = sys.stdout,
    stop: Callable[[], bool] = lambda: False,
    redraw: bool | None = None,
) -> int:
    """Print records until ``limit`` were shown or ``stop()``; returns how many were shown.
    ``redraw``: hourly table redrawn in place (default: when ``out`` is a terminal)."""
    if redraw is None:
        redraw = out.isatty()
    if hourly and output == "table" and redraw:
        return await _tail_hourly_in_place(
            settings, team=team, from_beginning=from_beginning, limit=limit, out=out, stop=stop
        )
    topics = settings.topics
    topic = topics.usage_hourly if hourly else topics.usage
    columns = _HOURLY_COLUMNS if hourly else _USAGE_COLUMNS
    # No consumer group: a tail reads, it never moves anyone's committed offsets.
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        **kafka_auth(settings),
        auto_offset_reset="earliest" if from_beginning else "latest",
        # A batch line's usage is written in its result's transaction: one a fence or a crash
        # aborted is run again, and its usage written again; the aborted one is not shown.
        isolation_level="read_committed",
    )
    shown = 0
    await consumer.start()
    try:
        if output == "table":
            print(_header(columns), file=out, flush=True)
        while not stop() and (limit is None or shown < limit):
            batches = await consumer.getmany(timeout_ms=200)
            for message in (m for records in batches.values() for m in records):
                line = _format(message.value, team, output, columns)
                if line is None:
                    continue
                print(line, file=out, flush=True)
                shown += 1
                if limit is not None and shown >= limit:
                    return shown
    finally:
        await consumer.stop()
    return shown


async def _tail_hourly_in_place(
    settings: CommonSettings,
    *,
    team: str | None,
    from_beginning: bool,
    limit: int | None,
    out: TextIO,
    stop: Callable[[], bool],
) -> int:
    """The hourly table, one line per key at its latest revision, redrawn as records come."""
    consumer = AIOKafkaConsumer(
        settings.topics.usage_hourly,
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        **kafka_auth(settings),
        auto_offset_reset="earliest" if from_beginning else "latest",
        # A batch line's usage is written in its result's transaction: one a fence or a crash
        # aborted is run again, and its usage written again; the aborted one is not shown.
        isolation_level="read_committed",
    )
    latest: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    shown = 0
    await consumer.start()
    try:
        _draw(latest, out)
        while not stop() and (limit is None or shown < limit):
            batches = await consumer.getmany(timeout_ms=200)
            changed = False
            for message in (m for records in batches.values() for m in records):
                record = _record(message.value, team)
                if record is None:
                    continue
                hour, who, cls, model = (str(record.get(f)) for f in _KEY_FIELDS)
                key = (hour, who, cls, model)
                kept = latest.get(key)
                if kept is None or _revision(record) >= _revision(kept):
                    latest[key] = record
                    changed = True
                shown += 1
                if limit is not None and shown >= limit:
                    break
            if changed:
                _draw(latest, out)
    finally:
        await consumer.stop()
    return shown


def _revision(record: dict[str, Any]) -> int:
    revision = record.get("revision")
    return revision if isinstance(revision, int) else -1


def _draw(latest: dict[tuple[str, str, str, str], dict[str, Any]], out: TextIO) -> None:
    rows = [latest[key] for key in sorted(latest)][-_MAX_DRAWN_ROWS:]
    lines = [_header(_HOURLY_COLUMNS)]
    lines += [_row(_HOURLY_COLUMNS, [_cell(r, name) for name, _ in _HOURLY_COLUMNS]) for r in rows]
    out.write(_CLEAR + "\n".join(lines) + "\n")
    out.flush()


def _record(raw: bytes | None, team: str | None) -> dict[str, Any] | None:
    try:
        record = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or (team is not None and record.get("team") != team):
        return None
    return record


def _format(
    raw: bytes | None, team: str | None, output: str, columns: tuple[tuple[str, int], ...]
) -> str | None:
    record = _record(raw, team)
    if record is None:
        return None
    if output == "json":
        return orjson.dumps(record).decode()
    return _row(columns, [_cell(record, name) for name, _ in columns])


def _cmd_tail(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            tail_usage(
                settings,
                hourly=args.hourly,
                team=args.team,
                output=args.output,
                from_beginning=args.from_beginning,
                limit=args.limit,
            )
        )
    return 0


def add_usage_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``laneway usage tail``."""
    usage = subparsers.add_parser("usage", help="usage events and hourly rollups").add_subparsers(
        dest="usage_command", required=True
    )
    tail = usage.add_parser("tail", help="follow laneway.usage (or --hourly rollups)")
    tail.add_argument(
        "--hourly",
        action="store_true",
        help="follow laneway.usage.hourly (on a terminal: a table whose open hours update in "
        "place)",
    )
    tail.add_argument("--team", help="only this team's records")
    tail.add_argument("--output", "-o", choices=["table", "json"], default="table")
    tail.add_argument(
        "--from-beginning", action="store_true", help="start at the oldest retained record"
    )
    tail.add_argument(
        "--limit", type=int_from(1, 10**9), default=None, help="stop after this many records"
    )
    tail.set_defaults(func=_cmd_tail)
