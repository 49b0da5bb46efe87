"""``laneway shadow start MODEL --to TARGET --share 0.05 | status | stop MODEL``."""

from __future__ import annotations

import argparse
import time
from typing import Any

from laneway.errors import BadRequest
from laneway.settings import CommonSettings
from laneway.shadow import (
    ShadowComparison,
    ShadowStats,
    get_comparison,
    list_shadows,
    parse_share,
    start_shadow,
    stop_shadow,
)
from ops.with_redis import with_redis

__all__ = ["add_shadow_commands", "comparison_lines"]


def cmd_start(args: argparse.Namespace) -> int:
    share = parse_share(args.share)
    if not args.to.strip():
        raise BadRequest("--to must name the shadow's route", param="to")

    async def start(settings: CommonSettings, redis: Any) -> int:
        state = await start_shadow(
            redis, settings.keys, args.model, args.to, share, served=settings.models
        )
        print(
            f"shadow {state.model} → {state.target}: {state.share:.2%} of requests mirrored "
            "(answers discarded, usage marked shadow, not billed)"
        )
        return 0

    return with_redis(start)


def _side(name: str, stats: ShadowStats | None) -> str:
    if stats is None:
        return f"  {name:<8} no requests in the window"
    p50 = f"{stats.p50_ms:.0f}" if stats.p50_ms is not None else "-"
    p99 = f"{stats.p99_ms:.0f}" if stats.p99_ms is not None else "-"
    return (
        f"  {name:<8} {stats.requests:>8} {stats.errors:>7} {stats.error_rate:>8.2%} "
        f"{p50:>8} {p99:>8}"
    )


def comparison_lines(comparison: ShadowComparison, now: float) -> list[str]:
    """The comparison as the status prints it: one line a side, then the ratios."""
    lines = [
        f"  over the last {comparison.window_s:g} s (as of {now - comparison.ts:.0f} s ago); "
        "latency: engine start to end, successful requests",
        f"  {'':<8} {'requests':>8} {'errors':>7} {'err %':>8} {'P50 ms':>8} {'P99 ms':>8}",
        _side("primary", comparison.primary),
        _side("shadow", comparison.shadow),
    ]
    ratios = comparison.ratios()
    if ratios["p99_ratio"] is not None or ratios["error_rate_diff"] is not None:
        parts = []
        for name, label in (("p50_ratio", "P50"), ("p99_ratio", "P99")):
            value = ratios[name]
            if value is not None:
                parts.append(f"{label} {value:.2f}×")
        if ratios["error_rate_diff"] is not None:
            parts.append(f"error rate {ratios['error_rate_diff']:+.2%}")
        lines.append("  shadow against primary: " + ", ".join(parts))
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    async def status(settings: CommonSettings, redis: Any) -> int:
        shadows = await list_shadows(redis, settings.keys)
        if not shadows:
            print("no shadows")
            return 0
        now = time.time()
        for s in shadows:
            line = f"{s.model} → {s.target}: {s.status}, {s.share:.2%} of requests"
            print(f"{line}, since {now - s.since:.0f} s" + (f" ({s.reason})" if s.reason else ""))
            comparison = await get_comparison(redis, settings.keys, s.model)
            if comparison is None:
                print("  no comparison yet (the streams app writes one every few seconds)")
            else:
                print("\n".join(comparison_lines(comparison, now)))
        return 0

    return with_redis(status)


def cmd_stop(args: argparse.Namespace) -> int:
    async def stop(settings: CommonSettings, redis: Any) -> int:
        state = await stop_shadow(redis, settings.keys, args.model)
        print(f"shadow {state.model} → {state.target} stopped: no more mirrors")
        return 0

    return with_redis(stop)


def add_shadow_commands(sub: Any) -> None:
    shadow = sub.add_parser("shadow", help="shadow routes of a model").add_subparsers(
        dest="shadow_command", required=True
    )
    start = shadow.add_parser(
        "start", help="mirror a share of MODEL's requests to TARGET (answers discarded)"
    )
    start.add_argument("model", help="the model clients ask for")
    start.add_argument("--to", required=True, help="the shadow's route (the version on trial)")
    start.add_argument(
        "--share", required=True, help="the fraction of requests mirrored, e.g. 0.05 for 5 %%"
    )
    start.set_defaults(func=cmd_start)
    status = shadow.add_parser("status", help="each shadow and its comparison with the primary")
    status.set_defaults(func=cmd_status)
    stop = shadow.add_parser("stop", help="mirror no more of MODEL's requests")
    stop.add_argument("model")
    stop.set_defaults(func=cmd_stop)
