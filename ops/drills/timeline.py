"""A drill's timeline as a PNG (matplotlib): request rate, P99, lag and replicas over time."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from laneway.errors import ConfigError
from ops.drills.surge import WINDOW_S, SurgeRun, baseline_p99, window_p99s

__all__ = ["finish_figure", "or_nan", "pyplot", "write_timeline"]


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (a drill's timeline), or a ConfigError naming
    what to install."""
    try:
        import matplotlib as mpl  # noqa: PLC0415 - optional: only the drills draw

        mpl.use("Agg")  # no display: write files only
        from matplotlib import pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(
            "the drill's timeline needs matplotlib: .venv/bin/pip install 'laneway[drills]'"
        ) from exc
    return plt


def write_timeline(run: SurgeRun, path: Path, title: str) -> Path:
    """Draw ``run`` into ``path`` (PNG); returns the path."""
    plt = pyplot()
    plan, samples = run.plan, run.samples
    end = math.ceil(plan.surge_end + plan.after_s)
    fig, axes = plt.subplots(4, 1, figsize=(8, 8), sharex=True, dpi=80)
    sent = Counter(int(o.sent_at) for o in run.outcomes)
    ok = Counter(int(o.sent_at) for o in run.outcomes if o.status == 200)
    seconds = list(range(end))
    axes[0].plot(seconds, [sent[s] for s in seconds], label="sent")
    axes[0].plot(seconds, [ok[s] for s in seconds], label="answered 200")
    axes[0].set_ylabel("requests/s")
    windows = window_p99s(run)
    axes[1].step(
        [t + WINDOW_S for t, _ in windows],
        [v * 1000 if math.isfinite(v) else math.nan for _, v in windows],
        where="pre",
        label=f"P99 per {WINDOW_S:g} s (sent in)",
    )
    baseline = baseline_p99(run)
    axes[1].axhline(baseline * plan.p99_ratio * 1000, color="grey", linestyle="--",
                    label=f"{plan.p99_ratio:g}× baseline")  # fmt: skip
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    times = [s.t for s in samples]

    def series(pool: str, attribute: str) -> list[float]:
        values = []
        for s in samples:
            signal = s.signal.get(pool)
            values.append(math.nan if signal is None else float(getattr(signal, attribute)))
        return values

    axes[2].plot(times, series("completion", "lag"), label="completion lag")
    axes[2].plot(times, series("completion", "queued"), label="completion queued")
    axes[2].set_ylabel("records")
    axes[3].step(times, series("completion", "desired"), where="post", label="completion: signal")
    axes[3].step(times, [or_nan(s.members.get("completion")) for s in samples], where="post",
                 label="completion: group members")  # fmt: skip
    axes[3].step(times, series("chat", "desired"), where="post", label="chat: signal")
    axes[3].step(times, series("batch", "desired"), where="post", label="batch: signal",
                 linestyle=":")  # fmt: skip
    axes[3].set_ylabel("replicas")
    axes[3].set_xlabel("seconds since the drill began")
    for ax in axes:
        ax.axvspan(plan.surge_start, plan.surge_end, color="orange", alpha=0.12)
    return finish_figure(fig, axes, title, path)


def finish_figure(fig: Any, axes: Any, title: str, path: Path) -> Path:
    """Every drill timeline's last touches: legends, grid, title, the PNG written."""
    for ax in axes:
        ax.legend(loc="upper left", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)
    return path


def or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)
