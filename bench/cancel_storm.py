"""Cancel storm: typists abandon most completions; how much engine time goes to stale work?

N simulated typists each type bursts of keystrokes (one every 80–200 ms); every keystroke
sends a streamed completion on the typist's session (X-Laneway-Session / X-Laneway-Seq) and
abandons the previous one by closing its connection. After a burst the typist pauses, and
the burst's last completion runs to the end: that one is *kept*. The sim engine (a
simulation of a GPU, with realistic costs) counts engine time per request.

Three runs: no storm (kept completions only, the baseline latency), storm with the cancel
shield, storm without it. Printed per run: share of engine time spent on stale requests,
P50/P99 of kept completions, HTTP error rate, open requests at the ingress, and the load
generator's own loop lag (how much of a kept completion's measured wait is the client's).

The storm and its baseline are compared on the same stack, window by window (no storm,
storm, storm, no storm, ...: ``--rounds``), after a warm-up: a comparison across two stacks
started minutes apart would measure the broker's JIT and the shared host's speed as much as
the storm. The run without the shield needs a stack of its own.

Two scenarios, each with the three runs:

- ``storm``: the typists alone on the fleet. The harshest case: nearly all engine time is
  completions, so without the shield most of it is stale.
- ``fleet``: the same typists on a mixed fleet, the case the issue's 15–20 % baseline
  describes. Beside the completion pool, a chat pool serves a few users streaming long
  conversations and a batch pool works through a document job that keeps its slots full.
  Each pool has its own sim engine; the stale share is over the engine time of all three.

Engine time is counted from the usage events that end inside a run's window (a steady
background is counted as much at the window's start as it is left out at its end).

``--null-test`` checks the storm-against-baseline comparison itself: the storm's windows carry
no storm either, so the two runs differ by chance alone, and an interval that leaves out zero
there is a false alarm.

    .venv/bin/python -m bench.cancel_storm [--typists 10] [--seconds 30] [--rounds 4]
        [--warmup 20] [--scenario both] [--stream-interval 1] [--null-test]
"""

from __future__ import annotations

import argparse

import uvloop

from bench._stack import BenchStack, bench_stack
from bench._storm_report import compare, print_header, report_run
from bench._storm_session import SCENARIOS, session


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--typists", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of one window")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="windows of each run, interleaved (default 4: with fewer, the P99's interval is "
        "too wide to tell a few milliseconds from chance)",
    )
    parser.add_argument(
        "--warmup", type=float, default=20.0, help="seconds of storm on a new stack first"
    )
    parser.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "both"),
        default="both",
        help="the typists alone (storm), on a mixed fleet (fleet), or both (default)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the workers' LANEWAY_STREAM_INTERVAL: tokens a streamed chunk gathers (default 1)",
    )
    parser.add_argument(
        "--null-test",
        action="store_true",
        help="no storm in either run of the shared stack (and no run without the shield): "
        "how far the comparison strays when nothing differs",
    )
    args = parser.parse_args()
    if (
        args.typists < 1
        or args.seconds <= 0
        or args.rounds < 1
        or args.warmup < 0
        or args.stream_interval < 1
    ):
        parser.error(
            "--typists, --rounds and --stream-interval must be at least 1, --seconds positive, "
            "--warmup not negative"
        )

    print_header(args)
    chosen = SCENARIOS.values() if args.scenario == "both" else [SCENARIOS[args.scenario]]
    for scenario in chosen:
        # The same stack (shield on) serves the storm and its baseline, window by window,
        # so both meet the same broker, the same JIT state and the same host speed.
        plan = [(True, ("no storm", "shield on")), (False, ("shield off",))]
        if args.null_test:
            plan = [(True, ("no storm", "no storm again"))]
        storms = frozenset({"shield on", "shield off"})
        for shield, runs in plan:
            stack = BenchStack(workers=scenario.workers(shield, args.stream_interval))
            with bench_stack(stack):
                key = stack.api_key("typists")
                results = uvloop.run(session(stack, key, args, scenario.fleet, runs, storms))
            for name in runs:
                report_run(scenario, name, *results[name])
            if shield:
                compare(results[runs[0]], results[runs[1]], f"{runs[1]} - {runs[0]}")


if __name__ == "__main__":
    main()
