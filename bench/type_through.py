"""Type-through: typists who accept ghost text word by word, with reuse on and off.

The typing storm of ``bench.upstream_storm`` (``--typists`` typists, bursts of keystrokes
40–200 ms apart, each a streamed completion of max_tokens 48 on its session, the previous one
abandoned), except that with probability ``--accept`` a keystroke types the next word of the
previous keystroke's suggestion, as far as it had streamed (a user accepting ghost text word
by word), instead of a random letter. The upstream is ``bench.upstream_server`` (a separate
process: ``--slots`` slots, ``--token-ms`` a token, a log of what it ran).

Three paths in one run, window by window (``--rounds``): ``direct`` (straight to the
upstream, for reference), ``reuse`` (through laneway, a team with type-through on) and
``no-reuse`` (the same stack, a team with it off). Printed per path: upstream requests per
keystroke and upstream slot-seconds per kept completion (both from the upstream's log), the
client's time to first token of kept completions, and for reused completions the time to
first token from their usage events. Targets at ``--accept 0.3``: ≥ 30 % fewer upstream
slot-seconds per kept completion with reuse than without, reused completions' TTFT P50 under
20 ms.

    .venv/bin/python -m bench.type_through [--accept 0.3] [--typists 12] [--seconds 20]
        [--rounds 2] [--slots 8] [--token-ms 15] [--prefill-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop

from bench._proc import machine
from bench._stack import BenchStack, bench_stack
from bench._stats import percentile
from bench._upstream import Upstream, drain, upstream_process
from bench.upstream_storm import usage_events
from ops.drills.http_pool import HttpPool

MAX_TOKENS = 48
UPSTREAM_PORT = 31890
PATHS = ("direct", "reuse", "no-reuse")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Window:
    path: str
    started: float = 0.0
    ended: float = 0.0
    sent: int = 0
    accepted: int = 0  # keystrokes that typed the suggestion's next word
    markers: set[str] = field(default_factory=set)
    kept_ttft: list[float] = field(default_factory=list)
    errors: int = 0


@dataclass
class _Suggestion:
    text: str = ""
    ttft_ms: float | None = None


async def _keystroke(
    http: HttpPool, body: dict[str, Any], headers: dict[str, str], seen: _Suggestion
) -> bool:
    """Stream one keystroke's suggestion into ``seen``; whether it ended well."""
    started = time.perf_counter()
    done = failed = False
    async with http.stream("/v1/completions", body, headers) as (status, _, lines):
        async for line in lines:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    failed = True
                    continue
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") or ""
                    if text and seen.ttft_ms is None:
                        seen.ttft_ms = (time.perf_counter() - started) * 1000
                    seen.text += text
            done = done or line == b"data: [DONE]"
    return status == 200 and done and not failed


def _next_word(suggestion: str) -> str | None:
    """The first whole word of what a suggestion streamed so far (with its space)."""
    head, space, _ = suggestion.partition(" ")
    return head + space if space and head else None


async def _typist(
    number: int, http: HttpPool, window: Window, deadline: float, model: str, accept: float
) -> None:
    rng = random.Random(number * 104729 + int(window.started))
    document = "".join(rng.choice(_LETTERS + " \n") for _ in range(400))
    session = f"typist-{number}-{int(window.started * 1000)}"
    seq = 0
    await asyncio.sleep(rng.uniform(0, 0.5))
    while time.monotonic() < deadline:
        previous: tuple[asyncio.Task[bool], _Suggestion] | None = None
        burst = rng.randint(3, 8)
        for keystroke in range(burst):
            seq += 1
            word = _next_word(previous[1].text) if previous is not None else None
            if word is not None and rng.random() < accept:
                document += word
                window.accepted += 1
            else:
                document += rng.choice(_LETTERS)
            # The prompt is the document itself (unique per typist: its random start), so a
            # keystroke's prompt extends the one before it by what was typed.
            body = {"model": model, "prompt": document, "max_tokens": MAX_TOKENS, "stream": True}
            headers = {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}
            window.sent += 1
            window.markers.add(document)
            seen = _Suggestion()
            task = asyncio.create_task(_keystroke(http, body, headers, seen))
            if previous is not None:
                await _abandon(previous[0])
            if keystroke < burst - 1:
                previous = (task, seen)
                await asyncio.sleep(rng.uniform(0.04, 0.2))
                continue
            try:
                ok = await task
            except (OSError, ValueError, asyncio.IncompleteReadError):
                ok = False
            if ok and seen.ttft_ms is not None:
                window.kept_ttft.append(seen.ttft_ms)
            else:
                window.errors += 1
        await asyncio.sleep(rng.uniform(0.3, 1.0))


async def _abandon(task: asyncio.Task[bool]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def run_window(
    path: str, stack: BenchStack, keys: dict[str, str], args: argparse.Namespace
) -> Window:
    window = Window(path, started=time.time())
    if path == "direct":
        http, model = HttpPool("127.0.0.1", UPSTREAM_PORT, {}), "up"
    else:
        auth = {"Authorization": f"Bearer {keys[path]}"}
        http, model = HttpPool("127.0.0.1", stack.ingress_port, auth), "laneway-code"
    deadline = time.monotonic() + args.seconds
    try:
        await asyncio.gather(
            *(_typist(i, http, window, deadline, model, args.accept) for i in range(args.typists))
        )
    finally:
        await http.close()
    window.ended = time.time()
    await asyncio.sleep(1.0)
    await drain(UPSTREAM_PORT)
    return window


@dataclass
class Verdict:
    keystrokes: int = 0
    accepted: int = 0
    upstream_requests: int = 0
    slot_s: float = 0.0
    kept: int = 0
    kept_ttft: list[float] = field(default_factory=list)
    reused: int = 0
    reused_ttft: list[float] = field(default_factory=list)
    errors: int = 0


def judge(
    window: Window, log: list[dict[str, Any]], usage: list[dict[str, Any]], into: Verdict
) -> None:
    mine = [e for e in log if e["prompt"] in window.markers]
    into.keystrokes += window.sent
    into.accepted += window.accepted
    into.upstream_requests += len(mine)
    into.slot_s += sum(e["end"] - e["start"] for e in mine if e["start"] is not None)
    into.kept += len(window.kept_ttft)
    into.kept_ttft += window.kept_ttft
    into.errors += window.errors
    reused = [
        e
        for e in usage
        if e.get("reused_from")
        and window.path != "direct"
        and window.started <= e["ts"] <= window.ended + 1
        and e.get("ttft_ms") is not None
    ]
    into.reused += len(reused)
    into.reused_ttft += [e["ttft_ms"] for e in reused]


def report(verdicts: dict[str, Verdict]) -> None:
    print(
        "| path | keystrokes | accepted words | upstream requests / keystroke | "
        "upstream slot-s / kept | kept | kept TTFT P50 / P99 ms | reused | reused TTFT P50 ms "
        "(usage) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path, v in verdicts.items():
        kept_ttft = (
            f"{percentile(v.kept_ttft, 50):.0f} / {percentile(v.kept_ttft, 99):.0f}"
            if v.kept_ttft
            else "-"
        )
        reused_ttft = f"{percentile(v.reused_ttft, 50):.1f}" if v.reused_ttft else "-"
        print(
            f"| {path} | {v.keystrokes} | {v.accepted} | "
            f"{v.upstream_requests / max(1, v.keystrokes):.2f} | {v.slot_s / max(1, v.kept):.2f} | "
            f"{v.kept} | {kept_ttft} | {v.reused} | {reused_ttft} | {v.errors} |"
        )
    on = verdicts["reuse"]
    saved = _saved(verdicts)
    print()
    print(
        f"upstream slot-seconds per kept completion, reuse vs not: {saved * 100:.0f} % fewer "
        f"({'met' if saved >= 0.3 else 'MISSED'}, target ≥ 30 %)"
    )
    if on.reused_ttft:
        p50 = percentile(on.reused_ttft, 50)
        print(
            f"reused completions' TTFT P50: {p50:.1f} ms ({'met' if p50 < 20 else 'MISSED'}, "
            "target < 20 ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.type_through", description=__doc__)
    parser.add_argument("--accept", type=float, default=0.3, help="chance a keystroke accepts")
    parser.add_argument("--typists", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--token-ms", type=float, default=15.0)
    parser.add_argument(
        "--prefill-ms", type=float, default=0.0, help="the upstream's time before a first token"
    )
    args = parser.parse_args()
    if not 0 <= args.accept <= 1:
        parser.error(f"--accept {args.accept} must be within 0 and 1")
    stack = BenchStack(
        workers=[
            {
                "LANEWAY_POOL": "completion",
                "LANEWAY_ENGINE": "openai",
                "LANEWAY_UPSTREAM_URL": f"http://127.0.0.1:{UPSTREAM_PORT}/v1",
                "LANEWAY_UPSTREAM_MODEL": "up",
            }
        ]
    )
    print(f"# {machine()}")
    print(
        f"# accept {args.accept:g}; {args.typists} typists, {args.seconds:.0f} s windows, "
        f"{args.rounds} rounds; upstream {args.slots} slots, {args.token_ms:g} ms/token, "
        f"prefill {args.prefill_ms:g} ms"
    )
    with (
        upstream_process(
            UPSTREAM_PORT, slots=args.slots, token_ms=args.token_ms, prefill_ms=args.prefill_ms
        ) as upstream,
        bench_stack(stack),
    ):
        keys = {
            "reuse": stack.api_key("reuse"),
            "no-reuse": stack.api_key("no-reuse", type_through=False),
        }
        verdicts = _run(stack, upstream, keys, args)
    report(verdicts)


def _run(
    stack: BenchStack, upstream: Upstream, keys: dict[str, str], args: argparse.Namespace
) -> dict[str, Verdict]:
    async def windows() -> list[Window]:
        done = []
        for round_ in range(args.rounds):
            for path in PATHS:
                window = await run_window(path, stack, keys, args)
                print(
                    f"# round {round_ + 1} {path}: {window.sent} keystrokes, "
                    f"{window.accepted} accepted words, {len(window.kept_ttft)} kept",
                    flush=True,
                )
                done.append(window)
        return done

    done = uvloop.run(windows())
    usage = uvloop.run(usage_events(stack))
    log = upstream.entries()
    verdicts = {path: Verdict() for path in PATHS}
    rounds = [{path: Verdict() for path in PATHS} for _ in range(args.rounds)]
    for i, window in enumerate(done):
        judge(window, log, usage, verdicts[window.path])
        judge(window, log, usage, rounds[i // len(PATHS)][window.path])
    per_round = ", ".join(f"{100 * _saved(r):.0f} %" for r in rounds)
    print(f"# slot-seconds per kept completion saved by reuse, per round: {per_round}")
    return verdicts


def _saved(verdicts: dict[str, Verdict]) -> float:
    """The share of upstream slot-seconds per kept completion that reuse saved."""
    on, off = verdicts["reuse"], verdicts["no-reuse"]
    per_on, per_off = on.slot_s / max(1, on.kept), off.slot_s / max(1, off.kept)
    return 1 - per_on / per_off if per_off else 0.0


if __name__ == "__main__":
    main()
