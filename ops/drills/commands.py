"""``laneway drill surge | memory | canary | chaos | storm``: the command line of the drills."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from ingress.settings import IngressSettings
from laneway.arguments import finite_float
from laneway.canary import parse_steps
from laneway.errors import ConfigError
from laneway.settings import load_settings
from ops.devstack import port_in_use
from ops.drills.canary import CanaryPlan, CanaryRun, run_canary
from ops.drills.canary import judge as canary_judge
from ops.drills.canary import summary as canary_summary
from ops.drills.canary import table as canary_table
from ops.drills.canary import write_timeline as write_canary_timeline
from ops.drills.chaos import ChaosPlan, run_chaos
from ops.drills.chaos_report import details, events_table, tally_table
from ops.drills.memory import MemoryPlan, MemoryRun
from ops.drills.memory import judge as memory_judge
from ops.drills.memory import summary as memory_summary
from ops.drills.memory import write_timeline as write_memory_timeline
from ops.drills.memory_drive import run_memory
from ops.drills.observe import StackObserver
from ops.drills.preflight import check_ready, output_path, report, say
from ops.drills.storm_command import add_storm_command
from ops.drills.surge import SurgePlan, judge, phase_summary, run_surge, table
from ops.drills.topology import TopologyPlan
from ops.settings import StackSettings
from streams.settings import StreamsSettings
from workers.settings import WorkerSettings

__all__ = ["add_drill_commands"]


def add_drill_commands(sub: Any) -> None:
    """Add ``drill surge | memory | canary | chaos | storm`` to the ``laneway`` parser's
    subcommands."""
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
    surge.add_argument(
        "--baseline-rps", type=finite_float, default=3.0, help="completions per second"
    )
    surge.add_argument("--factor", type=finite_float, default=5.0, help="the surge's rate multiple")
    surge.add_argument("--baseline-s", type=finite_float, default=30.0)
    surge.add_argument("--surge-s", type=finite_float, default=60.0)
    surge.add_argument(
        "--after-s", type=finite_float, default=75.0, help="long enough to see the scale-in"
    )
    surge.add_argument("--max-tokens", type=int, default=16)
    surge.add_argument("--out", default="", help="PNG path (default: <data dir>/drills/...)")
    surge.set_defaults(func=cmd_drill_surge)
    memory = drills.add_parser(
        "memory",
        help="engine memory held at ≥ 90 %%: batch and lo-band work shed and finished later",
        description="Runs against `laneway up` (same LANEWAY_* ports) with simulated engines; "
        "holds their KV memory through Redis for the hold phase, prints a verdict table and "
        "writes a PNG timeline (see docs/drills.md).",
    )
    memory.add_argument("--key", help="an API key (or LANEWAY_API_KEY) of a team big enough")
    memory.add_argument("--url", default="", help="ingress base URL (default: LANEWAY_PORT's)")
    memory.add_argument(
        "--short", action="store_true", help="a small drill of about a minute (fewer lines)"
    )
    memory.add_argument("--hi-rps", type=finite_float, help="hi-band completions per second (5)")
    memory.add_argument("--lo-rps", type=finite_float, help="lo-band chats per second (1)")
    memory.add_argument("--baseline-s", type=finite_float, help="before the hold (30)")
    memory.add_argument(
        "--hold-s", type=finite_float, help="the hold; the chat deadline bounds it (20)"
    )
    memory.add_argument("--after-s", type=finite_float, help="traffic after the hold (20)")
    memory.add_argument("--hold", type=finite_float, help="share of KV memory held (0.93)")
    memory.add_argument("--batch-lines", type=int, help="lines of the batch job (400)")
    memory.add_argument("--out", default="", help="PNG path (default: <data dir>/drills/...)")
    memory.set_defaults(func=cmd_drill_memory)
    canary = drills.add_parser(
        "canary",
        help="a healthy canary walks 1 → 5 → 10 → 100 %%, a faulty one is rolled back",
        description="Runs against `laneway up` started with a faulty route and short canary "
        "windows (see docs/drills.md); prints a verdict table and writes a PNG timeline.",
    )
    canary.add_argument("--key", help="an API key (or LANEWAY_API_KEY) of a team big enough")
    canary.add_argument("--url", default="", help="ingress base URL (default: LANEWAY_PORT's)")
    canary.add_argument("--model", default="laneway-code")
    canary.add_argument("--to", default="laneway-code-v2", help="the healthy canary's route")
    canary.add_argument(
        "--faulty", default="laneway-code-bad", help="a route the engine fails (the rollback)"
    )
    canary.add_argument("--steps", default="1,5,10,100")
    canary.add_argument("--rps", type=finite_float, default=20.0, help="completions per second")
    canary.add_argument("--sessions", type=int, default=400, help="distinct sessions")
    canary.add_argument("--out", default="", help="PNG path (default: <data dir>/drills/...)")
    canary.set_defaults(func=cmd_drill_canary)
    chaos = drills.add_parser(
        "chaos",
        help="kill workers, a broker, Redis and an ingress under load: nothing lost, "
        "nothing twice?",
        description="Starts a topology of its own (3 KRaft brokers, replication 3, min ISR "
        "2; Redis; 2 ingresses; 2 workers per pool on the simulated engine; the streams "
        "app) on ports from --base-port, breaks it under load and prints the count. Exit 0 "
        "when nothing was lost, duplicated or left without a usage event.",
    )
    chaos.add_argument(
        "--short", action="store_true", help="the faults closer together, less load (make test)"
    )
    chaos.add_argument(
        "--base-port",
        type=int,
        default=TopologyPlan().base_port,
        help=f"first of the {TopologyPlan().last_port - TopologyPlan().base_port + 1} ports it "
        f"uses (default {TopologyPlan().base_port})",
    )
    chaos.add_argument(
        "--data-dir",
        default="",
        help="a new directory for its data and logs "
        "(default: <LANEWAY_DATA_DIR>/drills/chaos-<time>)",
    )
    chaos.set_defaults(func=cmd_drill_chaos)
    add_storm_command(drills)


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
    out = output_path(Path(args.out or Path(stack.data_dir) / "drills" / f"surge-{stamp}.png"))
    check_ready(url)
    total = plan.baseline_s + plan.surge_s + plan.after_s
    say(
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
    from ops.drills.timeline import write_timeline  # noqa: PLC0415 - matplotlib is optional

    title = f"laneway surge drill {stamp}: {plan.factor:g}× {plan.baseline_rps:g}/s completions"
    rows = judge(run)
    report(f"{phase_summary(run)}\n\n{table(rows)}", lambda: write_timeline(run, out, title))
    return 0 if all(r.ok for r in rows) else 1


def memory_plan(args: argparse.Namespace, *, shed_at: float) -> MemoryPlan:
    """The plan of ``laneway drill memory``'s arguments (``--short``: the small one)."""
    given = {
        "hi_rps": args.hi_rps,
        "lo_rps": args.lo_rps,
        "baseline_s": args.baseline_s,
        "hold_s": args.hold_s,
        "after_s": args.after_s,
        "hold_share": args.hold,
        "batch_lines": args.batch_lines,
    }
    chosen = {name: value for name, value in given.items() if value is not None}
    chosen["shed_at"] = shed_at
    return MemoryPlan.short(**chosen) if args.short else MemoryPlan(**chosen)


def cmd_drill_memory(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    # The marks the stack's workers and ingress run by (the same LANEWAY_* environment).
    workers = load_settings(WorkerSettings)
    plan = memory_plan(args, shed_at=workers.memory_shed_at)
    chat_deadline_s = load_settings(IngressSettings).chat_deadline_ms / 1000
    # A lo chat sent as the hold begins waits for all of the pressure: the hold, the
    # heartbeat that reads its end, and the cool-down.
    pressure_s = plan.hold_s + workers.heartbeat_interval_s + workers.memory_cooldown_s + 1
    if pressure_s > chat_deadline_s:
        raise ConfigError(
            f"--hold-s {plan.hold_s:g} is too long for the lo chats' start deadline "
            f"({chat_deadline_s:g} s, LANEWAY_CHAT_DEADLINE_MS): a chat sent as the hold "
            f"begins would wait about {pressure_s:g} s (with the heartbeat and "
            "LANEWAY_MEMORY_COOLDOWN_S) and expire"
        )
    stack = load_settings(StackSettings)
    url = args.url or f"http://127.0.0.1:{stack.port}"
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = output_path(Path(args.out or Path(stack.data_dir) / "drills" / f"memory-{stamp}.png"))
    check_ready(url)
    say(
        f"memory drill against {url}: {plan.hi_rps:g} hi completions/s and {plan.lo_rps:g} lo "
        f"chats/s for {plan.baseline_s:g} s, then KV memory held at {plan.hold_share:.0%} for "
        f"{plan.hold_s:g} s, then {plan.after_s:g} s more; a batch job of {plan.batch_lines} "
        "lines throughout"
    )

    async def drive() -> MemoryRun:
        redis = aioredis.Redis.from_url(f"redis://127.0.0.1:{stack.redis_port}/0")
        try:
            # The stack `laneway up` runs: its Kafka on LANEWAY_KAFKA_PORT.
            local = stack.model_copy(update={"kafka_bootstrap": f"127.0.0.1:{stack.kafka_port}"})
            return await run_memory(
                plan, base_url=url, key=key, redis=redis, settings=local, say=say
            )
        finally:
            await redis.aclose()

    run = asyncio.run(drive())
    rows = memory_judge(run)
    title = f"laneway memory drill {stamp}: KV memory held at {plan.hold_share:.0%}"
    report(
        f"{memory_summary(run)}\n\n{table(rows)}", lambda: write_memory_timeline(run, out, title)
    )
    return 0 if all(r.ok for r in rows) else 1


def cmd_drill_canary(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    if args.rps <= 0 or args.sessions < 1:
        raise ConfigError(
            f"--rps must be above 0 and --sessions at least 1, not {args.rps:g} and {args.sessions}"
        )
    stack = load_settings(StackSettings)
    judged = load_settings(StreamsSettings)  # the windows the stack's streams app judges by
    plan = CanaryPlan(
        model=args.model,
        good_target=args.to,
        bad_target=args.faulty,
        steps=parse_steps(args.steps),
        rps=args.rps,
        sessions=args.sessions,
        window_s=judged.canary_window_s,
    )
    url = args.url or f"http://127.0.0.1:{stack.port}"
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    out = output_path(Path(args.out or Path(stack.data_dir) / "drills" / f"canary-{stamp}.png"))
    check_ready(url)
    need = 100 / plan.steps[0] * judged.canary_min_requests / plan.rps
    say(
        f"canary drill against {url}: {plan.rps:g}/s over {plan.sessions} sessions; steps of "
        f"{judged.canary_window_s:g} s and ≥ {judged.canary_min_requests} canary requests "
        f"(the first step about {max(need, judged.canary_window_s):.0f} s)"
    )

    async def drive() -> CanaryRun:
        redis = aioredis.Redis.from_url(f"redis://127.0.0.1:{stack.redis_port}/0")
        try:
            return await run_canary(
                plan,
                base_url=url,
                key=key,
                redis=redis,
                settings=stack,
                say=say,
            )
        finally:
            await redis.aclose()

    run = asyncio.run(drive())
    rows = canary_judge(run)
    title = f"laneway canary drill {stamp}: {plan.model} → {plan.good_target} / {plan.bad_target}"
    report(
        f"{canary_summary(run)}\n\n{canary_table(rows)}",
        lambda: write_canary_timeline(run, out, title),
    )
    return 0 if all(r.ok for r in rows) else 1


def cmd_drill_chaos(args: argparse.Namespace) -> int:
    plan = ChaosPlan.short() if args.short else ChaosPlan()
    topology = TopologyPlan(base_port=args.base_port)
    highest = 65535 - (topology.last_port - topology.base_port)
    if not 1024 <= topology.base_port <= highest:
        raise ConfigError(f"--base-port must be within 1024..{highest}, not {args.base_port}")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    # Absolute: the servers run with their data directory as working directory.
    data = Path(
        args.data_dir or Path(load_settings(StackSettings).data_dir) / "drills" / f"chaos-{stamp}"
    ).resolve()
    if data.exists() and not data.is_dir():
        raise ConfigError(f"--data-dir {data} is a file: name a directory (new or empty)")
    if data.exists() and any(data.iterdir()):
        raise ConfigError(
            f"--data-dir {data} is not empty: the drill counts what its topics hold, so it "
            "needs a directory of its own"
        )
    # The arguments first, then the machine: a port that another program holds is no
    # reason to hide a mistake in the command line.
    busy = [port for port in range(topology.base_port, topology.last_port + 1) if port_in_use(port)]
    if busy:
        raise ConfigError(
            f"--base-port {topology.base_port}: ports {busy} of "
            f"{topology.base_port}..{topology.last_port} are taken; choose another base"
        )
    say(
        f"chaos drill{' (short)' if args.short else ''}: about {plan.load_s:.0f} s of load "
        f"plus start-up and settling; topology on ports {topology.base_port}.."
        f"{topology.last_port}, data and logs in {data}. Workers run the simulated engine "
        "(a GPU performance model, no GPU)."
    )
    # The drill kills brokers on purpose: its own clients' connection errors are expected
    # (the services log theirs in their own logs).
    kafka_log = logging.getLogger("aiokafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    try:
        run = asyncio.run(run_chaos(plan, topology, data))
    finally:
        kafka_log.setLevel(level)
    say(f"{events_table(run.events)}\n\n{tally_table(run.tally)}")
    if problems := details(run.tally):
        say(f"\n{problems}")
    say(
        f"\nbatch jobs {run.job_id} and {run.lean_job_id} (over its budget, {run.lean_waited} "
        f"lines waiting for it through the faults); whole drill {run.seconds:.0f} s; logs in "
        f"{data / 'logs'}"
    )
    return 0 if run.tally.target_met else 1
