"""One window of the CPU bench: the CPU each process used for a fixed rate of completions,
less what it used idle for as long (the broker and the streams app work when nothing comes in)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import uvloop

from bench._cpu_load import drive
from bench._proc import tree_cpu_seconds


@dataclass
class Window:
    who: str
    stream: bool
    sent: int = 0
    ok: int = 0
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process, idle subtracted


# After the load, before the window closes (see measure_window).
SETTLE_S = 3.0


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    cpu: dict[str, float] = {}
    for role, pid in pids.items():
        try:
            cpu[role] = tree_cpu_seconds(pid)
        except ProcessLookupError:
            raise SystemExit(
                f"bench.cpu: the {role} (pid {pid}) exited during the run; its log says why"
            ) from None
    return cpu


def measure_window(
    who: str,
    pids: dict[str, int],
    port: int,
    headers: dict[str, str],
    model: str,
    args: argparse.Namespace,
    stream: bool,
) -> Window:
    """Idle for ``seconds``, then loaded for as long: the load's CPU less the idle's.

    The window closes ``SETTLE_S`` after the last answer, so work a request causes after its
    answer (laneway's usage events, which the worker sends and the streams app folds; a
    peer's logging) counts for that window and not as the next window's idle."""
    before = _cpu(pids)
    time.sleep(args.seconds)
    idle = {r: v - before[r] for r, v in _cpu(pids).items()}
    before = _cpu(pids)
    started = time.monotonic()
    sent, ok, failed = uvloop.run(drive(port, headers, model, args.rate, args.seconds, stream))
    seconds = time.monotonic() - started
    time.sleep(SETTLE_S)
    after = _cpu(pids)
    # The idle window ran for args.seconds; the load ran a little longer (its tail), and the
    # window closed SETTLE_S after that.
    scale = (time.monotonic() - started) / args.seconds
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
