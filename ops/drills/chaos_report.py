"""The chaos drill's printout: what happened when, and the count as a Markdown table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ops.drills.chaos_audit import ChaosTally

__all__ = ["details", "events_table", "tally_table"]

# Ids listed per kind of problem; the rest are counted.
_SHOWN = 20


def events_table(events: Sequence[tuple[float, str]], since: float = 0.0) -> str:
    """The drill's timeline (seconds since ``since``)."""
    lines = ["| at | what |", "|---|---|"]
    lines += [f"| +{t - since:.1f} s | {text} |" for t, text in events]
    return "\n".join(lines)


def _by_kind(counts: Counter[str]) -> str:
    return ", ".join(f"{kind} × {n}" for kind, n in counts.most_common())


def _judged(count: int) -> tuple[str, str]:
    return "0", "PASS" if count == 0 else "FAIL"


def _counted(t: ChaosTally, count: int) -> str:
    if t.usage_counted is None:
        return "not read"
    return f"{count} ({sum(t.usage_counted.values())} counted, {sum(t.usage_ids.values())} ids)"


def tally_table(t: ChaosTally) -> str:
    """The count, with a verdict on the three numbers that must be 0."""
    interactive = t.accepted["completion"] + t.accepted["chat"]
    failed = sum(t.failed.values())
    rows: list[tuple[str, str, str, str]] = [
        (
            "accepted (stored on a request topic)",
            f"{sum(t.accepted.values())}: {t.accepted['completion']} completions, "
            f"{t.accepted['chat']} streamed chats, {t.accepted['batch']} batch lines",
            "",
            "",
        ),
        ("answered (the client saw the whole answer)", str(t.answered), "", ""),
        (
            "answered after the client's ingress died (usage: ok)",
            str(t.answered_after_ingress_died),
            "",
            "",
        ),
        (
            "explicitly failed (an HTTP error or an error event the client saw)",
            f"{failed}" + (f": {_by_kind(t.failed)}" if failed else ""),
            "",
            "",
        ),
        (
            "**lost** (accepted, never answered nor explicitly failed)",
            f"{len(t.lost)} of {interactive}",
            *_judged(len(t.lost)),
        ),
        (
            "batch lines without a result",
            f"{len(t.batch_missing)} of {t.batch_lines}",
            *_judged(len(t.batch_missing)),
        ),
        (
            "duplicated batch results (beyond one per line)",
            f"{t.batch_duplicates} ({t.batch_results} result records)",
            *_judged(t.batch_duplicates),
        ),
        (
            "usage events missing (accepted, no usage event)",
            f"{len(t.usage_missing)} ({t.usage_events} events read)",
            *_judged(len(t.usage_missing)),
        ),
        (
            "usage counted twice (streams rollups: requests beyond one per id)",
            _counted(t, t.usage_counted_twice),
            *_judged(t.usage_counted_twice if t.usage_counted is not None else 1),
        ),
        (
            "usage not counted (ids with an event the rollups miss)",
            _counted(t, t.usage_uncounted),
            *_judged(t.usage_uncounted),
        ),
        (
            "batch tokens charged to the teams' batch pools (Redis) / used (usage events, "
            "each line once)",
            "not read"
            if t.batch_tokens_charged is None
            else ", ".join(
                f"{team} {t.batch_tokens_charged.get(team, 0)} / {used}"
                for team, used in sorted(t.batch_tokens_used.items())
            ),
            *(("equal", "PASS" if t.batch_charge_off == 0 else "FAIL")),
        ),
        (
            "answered requests whose counted usage event is not ok",
            str(len(t.usage_not_ok)),
            "0",
            "PASS" if not t.usage_not_ok else "FAIL",
        ),
        (
            "second usage events on the topic (a re-run's; the streams app skips them)",
            f"{len(t.usage_twice)} ids, {t.usage_extra} extra events",
            "reported",
            "",
        ),
        (
            "ids whose events differ in outcome",
            str(len(t.usage_conflicting)),
            "reported",
            "",
        ),
        (
            "clients: requests sent / retried at the other ingress / never answered",
            f"{t.clients_sent} / {t.clients_retried} / {t.clients_without_answer}"
            + (f" ({_by_kind(t.unanswered)})" if t.unanswered else ""),
            "",
            "",
        ),
    ]
    lines = ["| measure | count | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def details(t: ChaosTally) -> str:
    """The ids behind every non-zero problem count (the first few of each)."""
    parts = []
    for title, items in (
        ("lost", t.lost),
        ("batch lines without a result", t.batch_missing),
        ("usage events missing", t.usage_missing),
        ("answered, usage not ok", t.usage_not_ok),
        ("ids whose usage events differ in outcome", t.usage_conflicting),
    ):
        if items:
            shown = "\n".join(f"  {item}" for item in items[:_SHOWN])
            more = f"\n  ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
            parts.append(f"{title} ({len(items)}):\n{shown}{more}")
    if t.usage_counted is not None and t.usage_counted != t.usage_ids:
        per_class = ", ".join(
            f"{cls} {t.usage_counted[cls]} counted / {t.usage_ids[cls]} ids"
            for cls in sorted(set(t.usage_counted) | set(t.usage_ids))
        )
        parts.append(f"usage in the streams app's rollups by class: {per_class}")
    return "\n".join(parts)
