"""``laneway drill storm``: its command line (registered by ``ops.drills.commands``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis

from laneway.apikeys import lookup_team
from laneway.arguments import finite_float
from laneway.errors import ConfigError, LanewayError
from laneway.settings import load_settings
from ops.drills.canary import table
from ops.drills.preflight import check_ready, output_path, report, say
from ops.drills.storm import StormPlan, StormRun, judge, run_storm, summary, write_timeline
from ops.drills.surge import Verdict
from ops.settings import StackSettings

__all__ = ["add_storm_command"]


def add_storm_command(drills: Any) -> None:
    storm = drills.add_parser(
        "storm",
        help="typists abandon most completions: is the stale work kept off the engine?",
        description="Runs against `laneway up` (same LANEWAY_* ports): calm and storm windows "
        "alternate (ABBA) after a warm-up; prints a verdict table and writes a PNG timeline.",
    )
    storm.add_argument("--key", help="an API key (or LANEWAY_API_KEY) of a team big enough")
    storm.add_argument("--url", default="", help="ingress base URL (default: LANEWAY_PORT's)")
    storm.add_argument("--typists", type=int, default=10)
    storm.add_argument("--window-s", type=finite_float, default=30.0, help="length of one window")
    storm.add_argument("--rounds", type=int, default=2, help="windows of each phase (ABBA)")
    storm.add_argument("--warmup-s", type=finite_float, default=15.0, help="storm, not measured")
    storm.add_argument("--out", default="", help="PNG path (default: <data dir>/drills/...)")
    storm.set_defaults(func=cmd_drill_storm)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"--url must be an http://host:port address, not {url!r}")
    return parts.hostname, parts.port or 80


def cmd_drill_storm(args: argparse.Namespace) -> int:

    key = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    plan = StormPlan(
        typists=args.typists,
        window_s=args.window_s,
        rounds=args.rounds,
        warmup_s=args.warmup_s,
    )
    stack = load_settings(StackSettings)
    url = args.url or f"http://127.0.0.1:{stack.port}"
    address = _address(url)
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = output_path(Path(args.out or Path(stack.data_dir) / "drills" / f"storm-{stamp}.png"))
    check_ready(url)
    total = plan.warmup_s + 2 * plan.rounds * (plan.window_s + 4)
    say(
        f"storm drill against {url}: {plan.typists} typists, {plan.rounds} calm and "
        f"{plan.rounds} storm windows of {plan.window_s:g} s (ABBA) after {plan.warmup_s:g} s "
        f"of warm-up (about {total:.0f} s)"
    )

    async def drive() -> StormRun:
        redis = aioredis.Redis.from_url(f"redis://127.0.0.1:{stack.redis_port}/0")
        try:
            team = await lookup_team(redis, stack.keys, key)
        finally:
            await redis.aclose()
        if team is None:
            raise LanewayError("the API key is not known to this stack (`laneway keys create`)")
        return await run_storm(plan, address=address, key=key, team=team, settings=stack, say=say)

    run = asyncio.run(drive())
    rows: list[Verdict] = judge(run)
    title = (
        f"laneway storm drill {stamp}: {plan.typists} typists, ABBA windows of {plan.window_s:g} s"
    )
    report(f"{summary(run)}\n\n{table(rows)}", lambda: write_timeline(run, out, title))
    return 0 if all(r.ok for r in rows) else 1
