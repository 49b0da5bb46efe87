"""The surge drill's verdicts and timeline, from made-up observations (no stack, no clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneway.errors import ConfigError
from laneway.schema import ScalingDecision
from ops.cli import main
from ops.drills.load import Outcome
from ops.drills.observe import Sample
from ops.drills.surge import SurgePlan, SurgeRun, judge, p99, phase_summary, table
from ops.drills.timeline import write_timeline

PLAN = SurgePlan(baseline_rps=2, baseline_s=20, surge_s=30, after_s=10, warmup_s=5)


def _signal(pool: str, desired: int, replicas: int) -> ScalingDecision:
    return ScalingDecision(
        subject=f"scaling:{pool}", pool=pool, desired=desired, replicas=replicas, raw=desired
    )


def _run(scale_at: float, slow_until: float, *, chat_moves: bool = False) -> SurgeRun:
    """A run whose signal reaches 3 at ``scale_at`` and whose answers are slow (1 s, one
    unanswered) until ``slow_until``, 100 ms otherwise."""
    run = SurgeRun(PLAN)
    t = 0.0
    while t < 60:
        slow = PLAN.surge_start <= t < slow_until
        status = 504 if slow and int(t * 10) % 10 == 0 else 200
        run.outcomes.append(Outcome(t, 1.0 if slow else 0.1, status))
        t += 0.1
    for second in range(60):
        completion = 3 if second >= scale_at else 1
        chat = 2 if chat_moves and second == 40 else 1
        run.samples.append(
            Sample(
                float(second),
                signal={
                    "completion": _signal("completion", completion, completion),
                    "chat": _signal("chat", chat, 1),
                    "batch": _signal("batch", 1, 1),
                },
                members={"completion": completion, "chat": 1, "batch": 1},
            )
        )
    return run


def test_p99_is_the_nearest_rank() -> None:
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([0.5]) == 0.5


def test_a_surge_handled_in_time_passes_every_check() -> None:
    rows = judge(_run(scale_at=25, slow_until=35))
    assert [r.ok for r in rows] == [True] * 5, table(rows)
    assert rows[0].measured == "1 → 3 at +5.0 s"
    assert rows[1].measured == "1 → 3 at +5.0 s"
    assert rows[2].measured == (
        "baseline 100 ms, worst ∞ (unanswered); ≤ 150 ms for those sent from +15 s"
    )


def test_late_scaling_slow_recovery_and_a_moved_pool_fail() -> None:
    rows = judge(_run(scale_at=51, slow_until=45, chat_moves=True))
    verdicts = {r.check: r.ok for r in rows}
    assert verdicts == {
        "signal asks +2 completion replicas": False,  # +31 s
        "they join the consumer group": False,  # after the surge
        "completion P99 back within 1.5× baseline": True,  # from +25 s: within 60 s
        "chat untouched": False,
        "batch untouched": True,
    }
    never = judge(_run(scale_at=99, slow_until=99))
    assert never[0].measured == "never (from 1)"
    assert never[2].measured.endswith("not back")
    assert not never[2].ok


def test_the_phase_summary_counts_requests_and_failures() -> None:
    summary = phase_summary(_run(scale_at=25, slow_until=35))
    assert "| baseline | 2/s | 200 | 200 | 0 | 100 ms |" in summary
    assert "| surge | 10/s | 300 | 285 | 15 | ∞ (unanswered) |" in summary


def test_the_timeline_is_a_png(tmp_path: Path) -> None:
    path = write_timeline(_run(scale_at=25, slow_until=35), tmp_path / "t" / "surge.png", "t")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"factor": 1.0}, "--factor must be above 1"),
        ({"baseline_rps": 0}, "--baseline-rps must be above 0"),
        ({"baseline_s": 10}, "--baseline-s 10 leaves no baseline"),
        ({"surge_s": 1}, "--surge-s must be at least 5"),
    ],
)
def test_a_plan_that_cannot_be_judged_is_refused(plan: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SurgePlan(**plan)


def test_the_cli_names_what_is_missing_or_wrong(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LANEWAY_API_KEY", raising=False)
    assert main(["drill", "surge"]) == 2
    assert "an API key is needed: --key KEY or LANEWAY_API_KEY" in capsys.readouterr().err
    assert main(["drill", "surge", "--key", "k", "--factor", "0.5"]) == 2
    assert "--factor must be above 1 (a surge), not 0.5" in capsys.readouterr().err
    assert main(["drill", "surge", "--key", "k", "--url", "http://127.0.0.1:9"]) == 1
    assert "no laneway ingress answers at http://127.0.0.1:9" in capsys.readouterr().err
