"""The memory drill: its verdicts from made-up runs, its command line, and a short drill
against a live stack (real broker, Redis, ingress and simulated workers of every pool)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from laneway.errors import ConfigError
from laneway.settings import CommonSettings
from ops.cli import main
from ops.drills.load import Outcome
from ops.drills.memory import MemoryPlan, MemoryRun, MemorySample, judge, summary, write_timeline
from ops.drills.memory_drive import run_memory
from ops.drills.surge import table
from tests.stack import LiveStack

PLAN = MemoryPlan(baseline_s=20, hold_s=20, after_s=10, warmup_s=5, settle_s=5, batch_lines=4)


def _run(*, slow_hi: bool = False, lost_line: bool = False, kv: float = 0.93) -> MemoryRun:
    """A run where lo chat "lo-1" and batch line "b-1" were shed during the hold and
    finished after it; hi completions answered in 100 ms (300 ms while held if ``slow_hi``)."""
    run = MemoryRun(PLAN, batch_id="job", began_wall=1000.0)
    for i in range(500):
        t = i * 0.1
        held = PLAN.hold_start <= t < PLAN.hold_end
        run.hi.append(Outcome(t, 0.3 if slow_hi and held else 0.1, 200, f"hi-{i}"))
        run.usage.append({"id": f"hi-{i}", "status": "ok", "preempted": 0, "ts": 1000 + t})
    for i in range(5):
        run.lo.append(Outcome(i * 10.0, 1.0, 200, f"lo-{i}"))
        finished = 1000 + (42.0 if i == 1 else i * 10 + 1.0)
        if PLAN.judged_from <= finished - 1000 < PLAN.hold_end:
            finished += 20  # sent while held: it waited for the hold's end
        total_ms = (finished - 1000 - i * 10.0) * 1000
        run.usage.append(
            {
                "id": f"lo-{i}",
                "status": "ok",
                "preempted": int(i == 1),
                "ts": finished,
                "total_ms": total_ms,
            }
        )
    lines = range(3 if lost_line else 4)
    for i in lines:
        finished = 1000 + (45.0 if i == 1 else 5.0)
        run.usage.append(
            {
                "id": f"b-{i}",
                "job_id": "job",
                "status": "ok",
                "preempted": int(i == 1),
                "ts": finished,
            }
        )
    run.batch_total, run.batch_completed = 4, len(lines)
    run.batch_output_ids = [f"line-{i}" for i in lines]
    for second in range(50):
        held = PLAN.hold_start + 2 <= second < PLAN.hold_end + 2
        run.samples.append(
            MemorySample(
                float(second),
                kv=dict.fromkeys(("completion", "chat", "batch"), kv if held else 0.05),
                pressed=dict.fromkeys(("completion", "chat", "batch"), held),
                shed={"batch": int(held), "chat": int(held)},
                batch_done=min(4, second // 10),
            )
        )
    return run


def test_shed_then_finished_work_and_a_steady_hi_band_pass() -> None:
    rows = judge(_run())
    assert [r.ok for r in rows] == [True] * len(rows), table(rows)
    assert rows[1].measured == "1 lines shed; 0 finished while held"
    # lo-1 ran when the hold began; lo-3, sent during it, waited for its end.
    assert rows[3].measured == "1 aborted, 1 held back; 0 finished while held"
    assert rows[-1].measured == (
        "before 100 ms (per 5 s 100 ms–100 ms), while held 100 ms (per 5 s 100 ms–100 ms): 1.00×"
    )


def test_a_lost_line_a_slow_hi_band_and_a_low_hold_fail() -> None:
    failed = {r.check for r in judge(_run(slow_hi=True, lost_line=True, kv=0.85)) if not r.ok}
    assert failed == {
        "memory held at ≥ 90%",
        "batch finished later, 0 lost",
        "hi completion P99 within 1.2× of before",
    }


def test_a_shed_hi_completion_a_lost_chat_and_an_unshed_lo_band_fail() -> None:
    run = _run()
    run.usage = [e for e in run.usage if e["id"] != "lo-3"]  # the chat held back: lost
    for event in run.usage:
        if event["id"] == "hi-7":
            event["preempted"] = 1
        if event["id"] == "lo-1":
            event["preempted"] = 0  # and nothing of the lo band was aborted
    failed = {r.check for r in judge(run) if not r.ok}
    assert failed == {
        "hi band never shed",
        "lo band shed under pressure",
        "lo band finished later, 0 lost",
    }


def test_work_that_ran_while_held_is_not_shed() -> None:
    run = _run()
    for event in run.usage:
        if event["id"] == "b-1":
            event["ts"] = 1000 + PLAN.judged_from + 1  # finished in the middle of the hold
    verdicts = {r.check: r for r in judge(run)}
    assert not verdicts["batch shed under pressure"].ok
    assert verdicts["batch shed under pressure"].measured == "1 lines shed; 1 finished while held"


def test_the_summary_and_the_timeline(tmp_path: Path) -> None:
    run = _run()
    assert "| held | 200 | 200 | 100 ms |" in summary(run)
    path = write_timeline(run, tmp_path / "m" / "memory.png", "test")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"hold_share": 0.85}, "--hold must be above the shed mark"),
        ({"hold_s": 8}, "--hold-s 8 leaves nothing to judge"),
        ({"baseline_s": 6}, "--baseline-s 6 leaves no baseline"),
        ({"lo_rps": 0}, "--hi-rps and --lo-rps must be above 0"),
        ({"batch_lines": 0}, "--batch-lines must be at least 1"),
    ],
)
def test_a_plan_that_cannot_be_judged_is_refused(plan: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MemoryPlan(**plan)


def test_the_cli_names_what_is_missing_or_wrong(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LANEWAY_API_KEY", raising=False)
    assert main(["drill", "memory"]) == 2
    assert "an API key is needed: --key KEY or LANEWAY_API_KEY" in capsys.readouterr().err
    assert main(["drill", "memory", "--key", "k", "--hold", "1.5"]) == 2
    assert "--hold must be above the shed mark (0.9) and at most 1, not 1.5" in (
        capsys.readouterr().err
    )
    assert main(["drill", "memory", "--key", "k", "--hold-s", "40"]) == 2
    assert "--hold-s 40 is too long for the lo chats' start deadline (30 s" in (
        capsys.readouterr().err
    )
    assert main(["drill", "memory", "--key", "k", "--short", "--url", "http://127.0.0.1:9"]) == 1
    assert "no laneway ingress answers at http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_short_drill_sheds_and_finishes_everything(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    # Simulated engines slow enough that the job and the chats are still running when the
    # hold begins; the workers read the hold at each heartbeat (2 s). A batch line outlives
    # two of them (64 steps of 75 ms): the worker sheds the newest running line, and one
    # that ends as the abort comes is not shed, so the next beat must still find the other
    # running (with 1 s lines, both had ended by then: 0 shed, once in CI).
    for pool, slots, step_ms in (("completion", 32, 15.0), ("chat", 32, 15.0), ("batch", 2, 75.0)):
        await stack.start_worker(
            pool, sim_decode_ms_per_step=step_ms, sim_batch_slots=slots, memory_cooldown_s=1.0
        )
    key = await stack.api_key("drill", size=10_000)
    run = await run_memory(
        MemoryPlan.short(batch_lines=20),
        base_url=ingress.base_url,
        key=key,
        redis=stack.redis,
        settings=CommonSettings(**stack.common),
        say=lambda _line: None,
    )
    # Judged on the usage events of every request it sent, none missing.
    sent = {o.request_id for o in run.hi + run.lo}
    assert sent <= {e["id"] for e in run.usage}
    rows = {r.check: r for r in judge(run)}
    # Everything but the P99 ratio, a measurement this noisy machine reports in the docs.
    for check in (
        "memory held at ≥ 90%",
        "batch shed under pressure",
        "batch finished later, 0 lost",
        "lo band shed under pressure",
        "lo band finished later, 0 lost",
        "hi band never shed",
    ):
        assert rows[check].ok, table(list(rows.values()))
    assert await stack.redis.get(stack.worker_settings().keys.sim_kv_hold()) is None
