"""The CPU bench's table and its verdicts: laneway's CPU per completion against LiteLLM's,
the openai engine's worker against the sim engine's, and the saturation rates."""

from __future__ import annotations

from bench._cpu_window import Window

SIM_WHO = "laneway (sim engine)"


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
