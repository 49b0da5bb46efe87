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
in flight as ``--concurrency`` for ``--seconds`` and prints the completions per second each
served. Windows alternate laneway, peer, laneway, peer (``--rounds``).

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
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop

from bench._open_loop import open_loop
from bench._proc import machine, stat_cpu_seconds
from bench._stack import BenchStack, bench_stack
from bench._upstream import upstream_process
from ops.devstack import stop_processes
from ops.drills.http_pool import HttpPool

UPSTREAM_PORT = 31890
LITELLM_PORT = 31895
LITELLM_VENV = Path.home() / ".cache" / "laneway" / "litellm-venv"
LITELLM_KEY = "sk-laneway-bench"
MAX_TOKENS = 16
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
SIM_WHO = "laneway (sim engine)"


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and every process below it (LiteLLM's workers are children)."""
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            total += stat_cpu_seconds(Path(f"/proc/{current}/stat").read_text())
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except (OSError, IndexError, ValueError):
            continue
    return total


def cpu(pids: dict[str, int]) -> dict[str, float]:
    return {role: tree_cpu_seconds(pid) for role, pid in pids.items()}


@dataclass
class Window:
    who: str
    stream: bool
    sent: int = 0
    ok: int = 0
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process, idle subtracted


async def _drive(
    port: int, headers: dict[str, str], model: str, rate: float, seconds: float, stream: bool
) -> tuple[int, int, Counter[str]]:
    """Open-loop load: completion i goes at start + i/rate; returns (sent, answered 200, the
    other outcomes: status codes and exceptions, counted)."""
    http = HttpPool("127.0.0.1", port, headers)
    ok = 0
    failed: Counter[str] = Counter()

    async def one(i: int) -> None:
        nonlocal ok
        body = {
            "model": model,
            "prompt": f"def f{i}(x):\n    return",
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }
        try:
            if stream:
                async with http.stream("/v1/completions", body) as (status, _, lines):
                    async for _ in lines:
                        pass
            else:
                status, _, _ = await http.post("/v1/completions", body)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            failed[type(exc).__name__] += 1
            return
        if status == 200:
            ok += 1
        else:
            failed[str(status)] += 1

    total = int(rate * seconds)
    await asyncio.gather(*[asyncio.create_task(one(i)) async for i in open_loop(rate, total)])
    await http.close()
    return total, ok, failed


async def _saturate(
    port: int, headers: dict[str, str], model: str, concurrency: int, seconds: float
) -> float:
    """Closed loop: ``concurrency`` clients back to back; completions answered per second."""
    http = HttpPool("127.0.0.1", port, headers, size=concurrency)
    done = 0
    until = time.monotonic() + seconds

    async def client(n: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < until:
            body = {"model": model, "prompt": f"c{n} {i}", "max_tokens": MAX_TOKENS}
            try:
                status, _, _ = await http.post("/v1/completions", body)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                continue
            done += status == 200
            i += 1

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(concurrency)))
    await http.close()
    return done / (time.monotonic() - started)


def _window(
    who: str,
    pids: dict[str, int],
    port: int,
    headers: dict[str, str],
    model: str,
    args: argparse.Namespace,
    stream: bool,
) -> Window:
    """Idle for ``seconds``, then loaded for as long: the load's CPU less the idle's."""
    before = cpu(pids)
    time.sleep(args.seconds)
    idle = {r: v - before[r] for r, v in cpu(pids).items()}
    before = cpu(pids)
    started = time.monotonic()
    sent, ok, failed = uvloop.run(_drive(port, headers, model, args.rate, args.seconds, stream))
    seconds = time.monotonic() - started
    after = cpu(pids)
    # The idle window ran for args.seconds; the load ran a little longer (its tail).
    scale = seconds / args.seconds
    window = Window(who, stream, sent=sent, ok=ok, seconds=seconds)
    window.cpu_s = {r: after[r] - before[r] - idle[r] * scale for r in pids}
    print(
        f"# {who} stream={stream}: {ok}/{sent} answered in {seconds:.1f}s"
        + (f" (the others: {dict(failed)})" if failed else "")
        + "; "
        + "  ".join(f"{r} {1000 * v / max(1, ok):.2f}" for r, v in window.cpu_s.items()),
        flush=True,
    )
    return window


@contextmanager
def litellm_proxy(workers: int) -> Iterator[int]:
    """LiteLLM's proxy on LITELLM_PORT in front of the upstream; yields its pid."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        print(f"# installing LiteLLM into {LITELLM_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True
        )
    config = Path(tempfile.mkdtemp(prefix="laneway-litellm-")) / "config.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: up\n"
        "    litellm_params:\n"
        "      model: openai/up\n"
        f"      api_base: http://127.0.0.1:{UPSTREAM_PORT}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    # Its proxy wants a master key (clients send it, as laneway's send theirs), and would
    # fetch a model price map from the internet at start.
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_MASTER_KEY": LITELLM_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    proc = subprocess.Popen(
        [
            str(binary),
            "--config",
            str(config),
            "--port",
            str(LITELLM_PORT),
            "--num_workers",
            str(workers),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{LITELLM_PORT}/health/liveliness", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("LiteLLM's proxy did not start") from None
                time.sleep(0.5)
        yield proc.pid
    finally:
        stop_processes([proc])


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
    sent, ok, failed = uvloop.run(_drive(stack.ingress_port, auth, "laneway-code", 40, 5, False))
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


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def report(
    windows: list[Window], saturation: dict[str, list[float]], floor: list[float] | None = None
) -> None:
    print("| who, answers | completions | CPU-ms per completion, by process | total |")
    print("|---|---|---|---|")
    totals: dict[tuple[str, bool], list[float]] = {}
    workers: dict[tuple[str, bool], list[float]] = {}
    for w in windows:
        per = {r: 1000 * v / max(1, w.ok) for r, v in w.cpu_s.items()}
        total = sum(per.values())
        totals.setdefault((w.who, w.stream), []).append(total)
        if "worker" in per:
            workers.setdefault((w.who, w.stream), []).append(per["worker"])
        parts = ", ".join(f"{r} {v:.2f}" for r, v in per.items())
        kind = "streamed" if w.stream else "not streamed"
        print(f"| {w.who}, {kind} | {w.ok} | {parts} | {total:.2f} |")
    print()
    for stream in (False, True):
        ours, theirs = totals.get(("laneway", stream)), totals.get(("litellm", stream))
        if ours and theirs:
            ratio = (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))
            kind = "streamed" if stream else "not streamed"
            verdict = "met" if ratio <= 0.3 else "MISSED"
            print(f"{kind}: laneway / LiteLLM CPU-ms per completion {ratio:.2f} ({verdict}, ≤ 0.3)")
        upstream, sim = workers.get(("laneway", stream)), workers.get((SIM_WHO, stream))
        if upstream and sim:
            kind = "streamed" if stream else "not streamed"
            extra = _mean(upstream) - _mean(sim)
            line = (
                f"{kind}: worker CPU-ms per completion, openai engine {_mean(upstream):.2f} "
                f"(spread {min(upstream):.2f}–{max(upstream):.2f}), sim engine {_mean(sim):.2f} "
                f"({min(sim):.2f}–{max(sim):.2f}): the upstream costs the worker {extra:+.2f}"
            )
            if floor:
                verdict = "met" if extra <= _mean(floor) else "MISSED"
                line += (
                    f"; the exchange alone {_mean(floor):.2f} ({min(floor):.2f}–"
                    f"{max(floor):.2f}) ({verdict}, ≤ the exchange alone)"
                )
            print(line)
    if saturation.get("laneway") and saturation.get("litellm"):
        ours_rate = max(saturation["laneway"])
        theirs_rate = max(saturation["litellm"])
        ratio = ours_rate / theirs_rate
        verdict = "met" if ratio >= 4 else "MISSED"
        print(
            f"saturation: laneway {ours_rate:.0f}/s, LiteLLM {theirs_rate:.0f}/s, "
            f"{ratio:.1f}× ({verdict}, ≥ 4×)"
        )


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
        litellm_proxy(args.litellm_workers) if args.peer == "litellm" else _nothing() as peer,
    ):
        key = stack.api_key("cpu")
        ours = dict(stack.pids)
        auth = {"Authorization": f"Bearer {key}"}
        peer_auth = {"Authorization": f"Bearer {LITELLM_KEY}"}
        uvloop.run(_drive(stack.ingress_port, auth, "laneway-code", args.rate, 10, False))
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
                            _window(
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
                        _window(
                            "laneway", ours, stack.ingress_port, auth, "laneway-code", args, stream
                        )
                    )
                    if peer is not None:
                        windows.append(
                            _window(
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
                        _saturate(stack.ingress_port, auth, "laneway-code", args.concurrency, 10)
                    )
                    saturation.setdefault("laneway", []).append(rate)
                    print(f"# laneway saturation {rate:.0f}/s", flush=True)
                    if peer is not None:
                        rate = uvloop.run(
                            _saturate(LITELLM_PORT, peer_auth, "up", args.concurrency, 10)
                        )
                        saturation.setdefault("litellm", []).append(rate)
                        print(f"# litellm saturation {rate:.0f}/s", flush=True)
    report(windows, saturation, floor)


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
