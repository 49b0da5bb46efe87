"""bench/ as a whole: every bench module imports (a helper moved between modules breaks no
bench), `make bench` runs every bench docs/benchmarks.md reports, the parsers of what a bench
reads (/proc, Server-Timing) read it right, and a bench stopped with SIGTERM still stops the
services it started."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench
from bench._proc import stat_cpu_seconds, tree_cpu_seconds
from ops.drills.http_pool import server_timing

MODULES = sorted(info.name for info in pkgutil.iter_modules(bench.__path__))
ROOT = Path(__file__).resolve().parent.parent


def test_there_are_benches_to_import() -> None:
    assert {"cancel_storm", "overhead", "_stats"} <= set(MODULES)


def _make_target(name: str) -> str:
    """A Makefile target's recipe: the lines after ``name:`` up to the first blank one."""
    text = (ROOT / "Makefile").read_text()
    return text.split(f"\n{name}:", 1)[1].split("\n\n", 1)[0]


def test_make_bench_runs_every_bench_the_benchmarks_page_reports() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    reported = set(re.findall(r"\*\*Command:\*\*\s+`\.venv/bin/python\s+-m\s+bench\.(\w+)", page))
    run = set(re.findall(r"-m bench\.(\w+)", _make_target("bench")))
    assert len(reported) >= 10, "the page's **Command:** lines are no longer found"
    assert reported - run == set(), "make bench leaves out benches docs/benchmarks.md reports"
    assert run <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")


def test_stat_cpu_seconds_reads_past_a_command_name_with_spaces_and_parentheses() -> None:
    # /proc/<pid>/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
    # majflt cmajflt utime stime ...; a thread may name itself "C2 Compiler) x (".
    ticks = os.sysconf("SC_CLK_TCK")
    stat = f"4242 (C2 Compiler) x () S 1 4242 4242 0 -1 4194560 10 0 0 0 {3 * ticks} {ticks} 0 0"
    assert stat_cpu_seconds(stat) == pytest.approx(4.0)


def test_tree_cpu_seconds_counts_the_children_and_refuses_a_process_that_is_gone() -> None:
    """LiteLLM's workers are children of the process the bench started; a root that exited
    must not read as 0 s, which a window would take for negative CPU."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass"
    spawn = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}]); input()"
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(parent.pid) < 0.5:  # the parent idles: the child's burn
            assert time.monotonic() < deadline, "the child's CPU never showed in the tree"
            time.sleep(0.05)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the child with it
        parent.communicate()
    with pytest.raises(ProcessLookupError, match=str(parent.pid)):
        tree_cpu_seconds(parent.pid)


def test_server_timing_gives_each_part_in_ms() -> None:
    header = "laneway;dur=3.25, admit;dur=0.4, enqueue;dur=1.5, worker;dur=1.2"
    assert server_timing(header) == {
        "laneway": 3.25,
        "admit": 0.4,
        "enqueue": 1.5,
        "worker": 1.2,
    }


def test_server_timing_skips_parts_without_a_duration() -> None:
    assert server_timing("") == {}
    assert server_timing("cache, admit;dur=0.5") == {"admit": 0.5}


_STOPPED_BY_SIGTERM = """
import pathlib, signal, sys, time
from bench._stack import sigterm_unwinds
with sigterm_unwinds():
    try:
        print("started", flush=True)
        time.sleep(60)
    finally:
        pathlib.Path(sys.argv[1]).write_text("services stopped")
"""


def test_a_bench_stopped_with_sigterm_runs_its_cleanup(tmp_path: Path) -> None:
    # Python's default SIGTERM exits without running ``finally``: a bench's Kafka, Redis and
    # processes then outlived it and held the ports its next run needed.
    marker = tmp_path / "cleanup"
    with subprocess.Popen(
        [sys.executable, "-c", _STOPPED_BY_SIGTERM, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(bench.__file__).parent.parent,
    ) as bench_run:
        assert bench_run.stdout is not None
        assert bench_run.stdout.readline().strip() == "started"
        bench_run.send_signal(signal.SIGTERM)
        assert bench_run.wait(timeout=30) == 128 + signal.SIGTERM
    assert marker.read_text() == "services stopped"
