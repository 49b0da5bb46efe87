"""The storm drill: its verdicts from recorded runs (pure), its command line's refusals, and a
small run against the real stack (typists, the cancel shield, the usage topic read back)."""

from __future__ import annotations

from pathlib import Path

import pytest

from laneway.settings import CommonSettings
from ops.cli import main
from ops.drills.engine_time import Completion, EngineTime
from ops.drills.storm import StormPlan, StormRun, Window, judge, run_storm, summary, write_timeline
from ops.drills.typists import TypingStats
from tests.stack import LiveStack


def _window(phase: str, start: float, kept_ms: list[float], errors: int = 0) -> Window:
    stats = TypingStats(sent=len(kept_ms) * (4 if phase == "storm" else 1), errors=errors)
    stats.kept = {f"{phase}{start}-{i}": ms for i, ms in enumerate(kept_ms)}
    stats.timing = {rid: {"sent_at": start + 1.0} for rid in stats.kept}
    return Window(phase, start, start + 10.0, stats)


def _run(
    *, stale_ms: float, storm_ms: float, ran_on: bool = False, storm_errors: int = 0
) -> StormRun:
    run = StormRun(StormPlan(), began=1000.0)
    run.windows = [
        _window("calm", 1000.0, [100.0] * 50),
        _window("storm", 1010.0, [storm_ms] * 50, errors=storm_errors),
        _window("storm", 1020.0, [storm_ms] * 50),
        _window("calm", 1030.0, [110.0] * 50),
    ]
    completions = [Completion(1005.0, f"c{i}", "ok", 100.0, 0.0) for i in range(10)]
    completions += [Completion(1015.0, f"s{i}", "ok", 100.0, 0.0) for i in range(10)]
    completions += [Completion(1015.0, f"d{i}", "superseded", 0.0, 0.0) for i in range(20)]
    completions.append(Completion(1025.0, "a", "superseded", 50.0 + stale_ms, stale_ms))
    if ran_on:  # the news came, and it ran on for 400 ms of engine time
        completions.append(Completion(1025.0, "r", "ok", 500.0, 400.0))
    run.engine = EngineTime(completions=completions)
    return run


def test_a_shielded_storm_passes() -> None:
    rows = judge(_run(stale_ms=5.0, storm_ms=120.0))
    assert [r.ok for r in rows] == [True] * 4, rows
    assert rows[0].measured == "0.5% (0.0 of 1.1 engine-s)"
    assert rows[1].measured == (
        "20 dropped before the engine; 1 aborted while running and 0 ended in the step the "
        "news came in, P99 5 ms after the news"
    )
    assert rows[2].measured.startswith("1.09× (120 ms vs 110 ms; windows: storm 120–120 ms")
    lines = summary(_run(stale_ms=5.0, storm_ms=120.0)).splitlines()
    assert lines[2].startswith("| calm | 2 | 100 | 100 | 110 | 110 | 1.0 | 0.0 | 0 | 0 |")
    assert lines[3].startswith("| storm | 2 | 400 | 100 | 120 | 120 | 1.1 | 0.5 | 20 | 1 |")


def test_waste_a_stale_request_that_ran_on_a_slow_storm_and_a_failure_fail() -> None:
    run = _run(stale_ms=500.0, storm_ms=400.0, ran_on=True, storm_errors=1)
    rows = judge(run)
    assert [r.ok for r in rows] == [False] * 4, rows


def test_the_storm_timeline_is_a_png(tmp_path: Path) -> None:
    path = write_timeline(_run(stale_ms=5.0, storm_ms=120.0), tmp_path / "storm.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        ([], 2, "an API key is needed: --key KEY or LANEWAY_API_KEY"),
        (["--key", "k", "--typists", "0"], 2, "--typists and --rounds must be at least 1"),
        (["--key", "k", "--window-s", "0.5"], 2, "--window-s must be at least 1 (not 0.5)"),
        (["--key", "k", "--url", "https://x:1"], 2, "--url must be an http://host:port address"),
        (["--key", "k", "--url", "http://127.0.0.1:9"], 1, "no laneway ingress answers at"),
    ],
)
def test_the_cli_names_what_is_wrong(
    argv: list[str],
    code: int,
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LANEWAY_API_KEY", raising=False)
    assert main(["drill", "storm", *argv]) == code
    assert message in capsys.readouterr().err


async def test_a_small_storm_on_the_real_stack(stack: LiveStack, tmp_path: Path) -> None:
    ingress = await stack.start_ingress()
    # A simulated GPU slow enough that a keystroke is still on it when the next one comes.
    await stack.start_worker(
        "completion", sim_decode_ms_per_step=5.0, sim_prefill_ms_per_token=0.01
    )
    key = await stack.api_key("typists", size=100)
    address = ("127.0.0.1", int(ingress.base_url.rsplit(":", 1)[1]))
    plan = StormPlan(typists=2, window_s=2.0, rounds=1, warmup_s=0.0)
    run = await run_storm(
        plan,
        address=address,
        key=key,
        team="typists",
        settings=CommonSettings(**stack.common),
        say=lambda _: None,
    )
    assert [w.phase for w in run.windows] == ["calm", "storm"]
    statuses = {c.id: c.status for c in run.engine.completions}
    kept = [rid for w in run.windows for rid in w.stats.kept]
    assert kept
    assert all(statuses.get(rid) == "ok" for rid in kept), statuses
    storm = run.windows[1].stats
    assert storm.sent > len(storm.kept)  # keystrokes were abandoned
    stale = [c for c in run.completions("storm") if c.status != "ok"]
    assert stale  # and the shield dropped or aborted them
    assert all(c.status in ("cancelled", "superseded", "expired") for c in stale if not c.engine_ms)
    assert len(judge(run)) == 4
    assert len(summary(run).splitlines()) == 4
    assert write_timeline(run, tmp_path / "storm.png", "small").stat().st_size > 0
