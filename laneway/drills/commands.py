"""``laneway drill surge``: the command line of the drills."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from laneway.drills.observe import StackObserver
from laneway.drills.surge import SurgePlan, judge, phase_summary, run_surge, table
from laneway.errors import ConfigError, LanewayError
from laneway.settings import StackSettings, load_settings

__all__ = ["add_drill_commands"]


def add_drill_commands(sub: Any) -> None:
    """Add ``drill surge`` to the ``laneway`` parser's subcommands."""
    drill = sub.add_parser("drill", help="operating drills against a running stack")
    drills = drill.add_subparsers(dest="drill_command", required=True)
    surge = drills.add_parser(
        "surge",
        help="completion traffic at N× its baseline for a minute: does the pool scale out?",
        description="Runs against `laneway up` (same LANEWAY_* ports); prints a verdict "
        "table and writes a PNG timeline.",
    )
    surge.add_argument("--key", help="an API key (or LANEWAY_API_KEY) of a team big enough")
    surge.add_argument("--url", default="", help="ingress base URL (default: LANEWAY_PORT's)")
    surge.add_argument("--baseline-rps", type=float, default=3.0, help="completions per second")
    surge.add_argument("--factor", type=float, default=5.0, help="the surge's rate multiple")
    surge.add_argument("--baseline-s", type=float, default=30.0)
    surge.add_argument("--surge-s", type=float, default=60.0)
    surge.add_argument(
        "--after-s", type=float, default=75.0, help="long enough to see the scale-in"
    )
    surge.add_argument("--max-tokens", type=int, default=16)
    surge.add_argument("--out", default="", help="PNG path (default: <data dir>/drills/...)")
    surge.set_defaults(func=cmd_drill_surge)


def cmd_drill_surge(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    if not 1 <= args.max_tokens <= 128:
        raise ConfigError(f"--max-tokens must be within 1..128, not {args.max_tokens}")
    plan = SurgePlan(
        baseline_rps=args.baseline_rps,
        factor=args.factor,
        baseline_s=args.baseline_s,
        surge_s=args.surge_s,
        after_s=args.after_s,
        max_tokens=args.max_tokens,
    )
    stack = load_settings(StackSettings)
    url = args.url or f"http://127.0.0.1:{stack.port}"
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = Path(args.out or Path(stack.data_dir) / "drills" / f"surge-{stamp}.png")
    _check_ready(url)
    total = plan.baseline_s + plan.surge_s + plan.after_s
    _say(
        f"surge drill: {plan.baseline_rps:g}/s for {plan.baseline_s:g} s, "
        f"{plan.baseline_rps * plan.factor:g}/s for {plan.surge_s:g} s, "
        f"{plan.baseline_rps:g}/s for {plan.after_s:g} s against {url} (about {total:.0f} s)"
    )

    async def drive() -> Any:
        observer = StackObserver(
            f"redis://127.0.0.1:{stack.redis_port}/0",
            f"127.0.0.1:{stack.kafka_port}",
            f"http://127.0.0.1:{stack.supervisor_port}/metrics",
            keys=stack.keys,
            topics=stack.topics,
        )
        async with observer:
            return await run_surge(plan, base_url=url, key=key, observer=observer)

    run = asyncio.run(drive())
    from laneway.drills.timeline import write_timeline  # noqa: PLC0415 - matplotlib is optional

    title = f"laneway surge drill {stamp}: {plan.factor:g}× {plan.baseline_rps:g}/s completions"
    rows = judge(run)
    _say(f"{phase_summary(run)}\n\n{table(rows)}\n\ntimeline: {write_timeline(run, out, title)}")
    return 0 if all(r.ok for r in rows) else 1


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _check_ready(url: str) -> None:
    try:
        response = httpx.get(f"{url}/readyz", timeout=5)
    except httpx.HTTPError as exc:
        raise LanewayError(
            f"no laneway ingress answers at {url} ({exc}); start the stack with `laneway up` "
            "(with the same LANEWAY_* ports) or pass --url"
        ) from exc
    if response.status_code != 200:
        raise LanewayError(f"the stack at {url} is not ready: {response.text}")
