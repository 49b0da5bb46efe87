"""CPU-milliseconds per completion, every process of the stack, beside LiteLLM on the same upstream.

laneway (broker, Redis, ingress, a completion worker with the openai engine, the streams app)
runs in front of an instant OpenAI-compatible upstream (``bench.upstream_server``, no token
time, as many slots as asked for). A fixed rate of completions (max_tokens 16) runs for
``--seconds``, streamed and not, and the CPU time of each process is read from
``/proc/<pid>/stat`` (children included) before and after; the same length of idle time,
measured in the same run, is subtracted (the broker and the streams app work when nothing
comes in). ``--peer litellm`` does the same for LiteLLM's proxy (``--litellm-workers``
processes) on the same upstream, in the same run, installed on demand into its own venv
(``~/.cache/laneway/litellm-venv``). ``--saturate`` then drives each with as many requests
in flight as ``--concurrency`` for 10 s a round and prints the completions per second each
served (the table: the best round). Windows alternate laneway, peer, laneway, peer
(``--rounds``).

``--worker-engines openai,sim`` also measures, in each round, the completion worker on the
sim engine (a simulation, at no time per token), restarting the worker between the two, and
the HTTP exchange with the upstream alone (``bench._http_floor``: the same requests from a bare
aiohttp client): the openai engine's worker should cost no more than the sim's plus that.

Targets: laneway's whole stack ≤ 0.3× LiteLLM's CPU-ms per completion; laneway's saturation
rate ≥ 4× LiteLLM's.

    .venv/bin/python -m bench.cpu [--rate 80] [--seconds 20] [--rounds 2] [--peer litellm]
        [--litellm-workers 2] [--saturate] [--concurrency 64] [--worker-engines openai,sim]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import uvloop

from bench._cpu_load import MAX_TOKENS, drive, saturate
from bench._cpu_report import SIM_WHO, report
from bench._cpu_window import Window, measure_window
from bench._litellm import LITELLM_KEY, LITELLM_PORT, litellm_proxy
from bench._proc import machine
from bench._stack import BenchStack, bench_stack
from bench._upstream import upstream_process
from ops.devstack import stop_processes

UPSTREAM_PORT = 31890
# The completion worker's settings per engine: each can take every request at once.
WORKER_ENGINES = {
    "openai": {
        "LANEWAY_POOL": "completion",
        "LANEWAY_ENGINE": "openai",
        "LANEWAY_UPSTREAM_URL": f"http://127.0.0.1:{UPSTREAM_PORT}/v1",
        "LANEWAY_UPSTREAM_MODEL": "up",
        "LANEWAY_UPSTREAM_SLOTS": "256",
        "LANEWAY_UPSTREAM_METRICS_URL": "",
        "LANEWAY_MAX_INFLIGHT": "256",
    },
    "sim": {
        "LANEWAY_POOL": "completion",
        "LANEWAY_ENGINE": "sim",
        "LANEWAY_SIM_PREFILL_MS_PER_TOKEN": "0",
        "LANEWAY_SIM_DECODE_MS_PER_STEP": "0",
        "LANEWAY_SIM_BATCH_SLOTS": "256",
        "LANEWAY_MAX_INFLIGHT": "256",
    },
}


def _run_worker(stack: BenchStack, engine: str, auth: dict[str, str]) -> None:
    """The stack's completion worker, restarted on ``engine`` (same worker id: it takes its
    partitions back at once), then warmed up with a few seconds of the load."""
    old = next(p for p in stack.procs if p.pid == stack.pids["worker"])
    stop_processes([old])
    stack.procs.remove(old)
    stack.spawn(
        "workers", {"LANEWAY_WORKER_ID": "bench-0", **WORKER_ENGINES[engine]}, role="worker"
    )
    stack.wait_ready({"completion"})
    sent, ok, failed = uvloop.run(drive(stack.ingress_port, auth, "laneway-code", 40, 5, False))
    if ok != sent:
        raise RuntimeError(
            f"the {engine} worker answered {ok} of {sent} warm-up completions: {dict(failed)}"
        )


def _http_floor(args: argparse.Namespace) -> float:
    """CPU-ms per request of the upstream exchange alone, at the bench's rate."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench._http_floor",
            f"--port={UPSTREAM_PORT}",
            f"--rate={args.rate}",
            f"--seconds={args.seconds}",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=args.seconds + 120,
    ).stdout.split()
    cpu_ms, answered = float(out[0]), int(out[1])
    print(f"# the HTTP exchange alone: {cpu_ms:.2f} CPU-ms per request ({answered} answered)")
    return cpu_ms


def _engines(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in WORKER_ENGINES]
    if not engines or unknown or len(set(engines)) != len(engines):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give each of {', '.join(WORKER_ENGINES)} at most once, comma-separated"
        )
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__)
    parser.add_argument("--rate", type=float, default=80.0, help="completions per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peer", choices=["none", "litellm"], default="none")
    parser.add_argument("--litellm-workers", type=int, default=2)
    parser.add_argument("--saturate", action="store_true")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--mode", choices=["both", "plain", "stream"], default="both")
    parser.add_argument(
        "--worker-engines",
        type=_engines,
        default=["openai"],
        help="comma-separated engines of the completion worker, a set of windows each per "
        "round (openai, sim); the peer and --saturate run beside the openai one",
    )
    args = parser.parse_args()
    streams = {"both": [False, True], "plain": [False], "stream": [True]}[args.mode]
    engines: list[str] = args.worker_engines
    if "openai" not in engines and (args.peer != "none" or args.saturate):
        parser.error(
            "--peer and --saturate run beside the openai engine: keep it in --worker-engines"
        )
    stack = BenchStack(workers=[WORKER_ENGINES[engines[0]]], streams=True)
    print(f"# {machine()}")
    print(
        f"# {args.rate:g} completions/s (max_tokens {MAX_TOKENS}) for {args.seconds:.0f} s, "
        f"idle subtracted; {args.rounds} rounds; peer {args.peer}; "
        f"worker engines {', '.join(engines)}"
    )
    windows: list[Window] = []
    saturation: dict[str, list[float]] = {}
    floor: list[float] = []
    with (
        upstream_process(UPSTREAM_PORT, slots=1024, token_ms=0) as _upstream,
        bench_stack(stack),
        litellm_proxy(args.litellm_workers, UPSTREAM_PORT)
        if args.peer == "litellm"
        else _nothing() as peer,
    ):
        key = stack.api_key("cpu")
        ours = dict(stack.pids)
        auth = {"Authorization": f"Bearer {key}"}
        peer_auth = {"Authorization": f"Bearer {LITELLM_KEY}"}
        # Both sides warm up alike before the first window (imports, caches, connections).
        uvloop.run(drive(stack.ingress_port, auth, "laneway-code", args.rate, 10, False))
        if peer is not None:
            uvloop.run(drive(LITELLM_PORT, peer_auth, "up", args.rate, 10, False))
        running = engines[0]
        for round_ in range(args.rounds):
            # ABBA: each engine as often first as second, against drift over the run.
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                if engine != running:
                    _run_worker(stack, engine, auth)
                    running = engine
                    ours = dict(stack.pids)
                if engine != "openai":
                    for stream in streams:
                        windows.append(
                            measure_window(
                                SIM_WHO,
                                ours,
                                stack.ingress_port,
                                auth,
                                "laneway-code",
                                args,
                                stream,
                            )
                        )
                    floor.append(_http_floor(args))
                    continue
                for stream in streams:
                    windows.append(
                        measure_window(
                            "laneway", ours, stack.ingress_port, auth, "laneway-code", args, stream
                        )
                    )
                    if peer is not None:
                        windows.append(
                            measure_window(
                                "litellm",
                                {"litellm": peer},
                                LITELLM_PORT,
                                peer_auth,
                                "up",
                                args,
                                stream,
                            )
                        )
                if args.saturate:
                    rate = uvloop.run(
                        saturate(stack.ingress_port, auth, "laneway-code", args.concurrency, 10)
                    )
                    saturation.setdefault("laneway", []).append(rate)
                    print(f"# laneway saturation {rate:.0f}/s", flush=True)
                    if peer is not None:
                        rate = uvloop.run(
                            saturate(LITELLM_PORT, peer_auth, "up", args.concurrency, 10)
                        )
                        saturation.setdefault("litellm", []).append(rate)
                        print(f"# litellm saturation {rate:.0f}/s", flush=True)
    report(windows, saturation, floor)


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
