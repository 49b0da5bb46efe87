"""``laneway canary start MODEL --to TARGET [--steps 1,5,10,100] | status | abort MODEL``."""

from __future__ import annotations

import argparse
import time
from typing import Any

from laneway.canary import abort_canary, list_canaries, parse_steps, start_canary
from laneway.settings import CommonSettings
from ops.with_redis import with_redis

__all__ = ["add_canary_commands"]


def cmd_start(args: argparse.Namespace) -> int:
    steps = parse_steps(args.steps)

    async def start(settings: CommonSettings, redis: Any) -> int:
        state = await start_canary(
            redis, settings.keys, args.model, args.to, steps, served=settings.models
        )
        print(
            f"canary {state.model} → {state.target}: steps {', '.join(f'{w:g}' for w in steps)} %,"
            f" now at {state.weight:g} %"
        )
        return 0

    return with_redis(start)


def cmd_status(args: argparse.Namespace) -> int:
    async def status(settings: CommonSettings, redis: Any) -> int:
        canaries = await list_canaries(redis, settings.keys)
        if not canaries:
            print("no canaries")
            return 0
        now = time.time()
        print(f"{'model':<24} {'target':<24} {'status':<12} {'weight':>7} {'step':>6}  since")
        for c in canaries:
            step = f"{c.step + 1}/{len(c.steps)}"
            line = f"{c.model:<24} {c.target:<24} {c.status:<12} {c.weight:>6g}% {step:>6}"
            print(f"{line}  {now - c.since:.0f}s ago" + (f"  ({c.reason})" if c.reason else ""))
        return 0

    return with_redis(status)


def cmd_abort(args: argparse.Namespace) -> int:
    async def abort(settings: CommonSettings, redis: Any) -> int:
        state = await abort_canary(redis, settings.keys, args.model)
        print(f"canary {state.model} → {state.target} aborted: all traffic on {state.model}")
        return 0

    return with_redis(abort)


def add_canary_commands(sub: Any) -> None:
    canary = sub.add_parser("canary", help="canary routes of a model").add_subparsers(
        dest="canary_command", required=True
    )
    start = canary.add_parser("start", help="send a growing share of MODEL's traffic to TARGET")
    start.add_argument("model", help="the model clients ask for (its stable route)")
    start.add_argument("--to", required=True, help="the canary's route (the new version)")
    start.add_argument("--steps", default="1,5,10,100", help="weights in %% (default 1,5,10,100)")
    start.set_defaults(func=cmd_start)
    status = canary.add_parser("status", help="where each canary stands")
    status.set_defaults(func=cmd_status)
    abort = canary.add_parser("abort", help="all of MODEL's traffic back on its stable route")
    abort.add_argument("model")
    abort.set_defaults(func=cmd_abort)
