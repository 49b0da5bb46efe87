"""The canary drill's verdicts, from recorded runs (pure: no stack)."""

from __future__ import annotations

from pathlib import Path

from laneway.canary import CanaryState
from ops.drills.canary import CanaryPlan, CanaryRun, Phase, Sent, judge, write_timeline

PLAN = CanaryPlan(steps=(1.0, 5.0, 100.0))


def _healthy(run: CanaryRun, flip_at: float | None = None) -> None:
    base = CanaryState(model="laneway-code", target="laneway-code-v2", steps=PLAN.steps)
    phase = Phase("healthy", "laneway-code-v2", started=0.0, ended=40.0)
    phase.samples = [(t, base) for t in range(20)]
    phase.samples += [(t, base.advanced(20.0)) for t in range(20, 40)]
    phase.samples.append((40.0, base.advanced(20.0).advanced(40.0)))
    run.phases.append(phase)
    # Session a: stable, then on the canary from the step change at 20 s on.
    for t in (2.0, 10.0, 21.0, 30.0):
        run.sent.append(
            Sent(t, "healthy", "a", 200, f"a{t}", "laneway-code-v2" if t > 20 else "laneway-code")
        )
    if flip_at is not None:  # session b changes route in the middle of a step
        run.sent.append(Sent(flip_at - 5, "healthy", "b", 200, "b1", "laneway-code"))
        run.sent.append(Sent(flip_at, "healthy", "b", 200, "b2", "laneway-code-v2"))


def _faulty(run: CanaryRun, *, rolled_back: bool) -> None:
    base = CanaryState(model="laneway-code", target="laneway-code-bad", steps=PLAN.steps)
    phase = Phase("faulty", "laneway-code-bad", started=41.0, ended=70.0)
    phase.samples = [(41.0 + t, base) for t in range(25)]
    end = base.ended("rolled_back", "error rate 30%", 66.0) if rolled_back else base.advanced(66.0)
    phase.samples.append((66.0, end))
    run.phases.append(phase)


def test_a_walk_a_rollback_and_sticky_sessions_pass() -> None:
    run = CanaryRun(PLAN)
    _healthy(run)
    _faulty(run, rolled_back=True)
    rows = judge(run)
    assert [r.ok for r in rows] == [True] * 5, rows
    assert "1 → 5 → promoted" in rows[0].measured


def test_a_mid_step_flip_and_a_faulty_canary_promoted_fail() -> None:
    run = CanaryRun(PLAN)
    _healthy(run, flip_at=12.0)
    _faulty(run, rolled_back=False)
    failed = {r.check for r in judge(run) if not r.ok}
    assert failed == {
        "no session changes route mid-step (healthy)",
        "a faulty canary is rolled back within one window",
    }


def test_a_walk_never_promoted_a_failed_request_and_a_faulty_mid_step_flip_fail() -> None:
    run = CanaryRun(PLAN)
    _healthy(run)
    run.phases[0].samples.pop()  # it walked 1 → 5 and was never promoted
    run.sent.append(Sent(5.0, "healthy", "c", 500, "c1", "laneway-code"))
    _faulty(run, rolled_back=True)
    run.sent += [  # no step change of the faulty canary between 45 and 50 s
        Sent(45.0, "faulty", "d", 200, "d1", "laneway-code"),
        Sent(50.0, "faulty", "d", 200, "d2", "laneway-code-bad"),
    ]
    failed = {r.check for r in judge(run) if not r.ok}
    assert failed == {
        "a healthy canary walks its steps",
        "the healthy phase fails no request",
        "no session changes route mid-step (faulty)",
    }


def test_the_canary_timeline_is_a_png(tmp_path: Path) -> None:
    run = CanaryRun(PLAN)
    _healthy(run)
    _faulty(run, rolled_back=True)
    path = write_timeline(run, tmp_path / "canary.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
