"""The chaos drill (issue 25): its count from made-up records, its clients against a fake
ingress, its command line, and the short drill itself on a topology of its own."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest

from laneway.errors import ConfigError
from ops.cli import main
from ops.devstack import port_in_use
from ops.drills.chaos import ChaosPlan
from ops.drills.chaos_audit import (
    Accepted,
    TopicRecord,
    batch_tokens_used,
    ids_with_usage,
    rollup_requests,
    tally,
)
from ops.drills.chaos_clients import (
    Attempt,
    AttemptOutcome,
    Balancer,
    ChaosClients,
    ClientRequest,
    tag_of,
    tag_text,
)
from ops.drills.chaos_report import details, tally_table
from ops.drills.topology import TopologyPlan


def _request(tag: str, *attempts: Attempt) -> ClientRequest:
    return ClientRequest(tag, "completion", list(attempts))


def _attempt(
    outcome: AttemptOutcome, rid: str | None, *, ingress: int = 0, ended: float = 5.0
) -> Attempt:
    status = {"answered": 200, "failed": 504}.get(outcome, 0)
    return Attempt(ingress, 1.0, ended, outcome, status, rid, "x" if outcome == "failed" else "")


def test_a_tag_survives_the_trip_through_a_prompt() -> None:
    assert tag_of(f"# {tag_text('c-12')}\ndef f():") == "c-12"
    assert tag_of("no tag here") is None


def test_each_accepted_request_is_answered_failed_or_lost() -> None:
    requests = [
        _request("c-1", _attempt("answered", "r1")),
        # A 504 carries no request id: the accepted request is matched by its tag.
        _request("c-2", _attempt("failed", None)),
        # Its ingress died under it (killed at 4.0): the usage event decides.
        _request("c-3", _attempt("transport", "r3", ended=4.5), _attempt("answered", "r3b")),
        _request("c-4", _attempt("transport", None, ended=4.5)),
        # A broken connection on an ingress that was not killed: nobody answered it.
        _request("c-5", _attempt("transport", "r5", ingress=1)),
        _request("c-6", _attempt("timeout", "r6")),
    ]
    accepted = [
        Accepted("r1", "c-1", "completion"),
        Accepted("r2", "c-2", "completion"),
        Accepted("r3", "c-3", "completion"),
        Accepted("r3b", "c-3", "completion"),
        Accepted("r4", "c-4", "chat"),
        Accepted("r5", "c-5", "completion"),
        Accepted("r6", "c-6", "completion"),
        Accepted("r7", None, "completion"),  # on the topic, but no client sent it
    ]
    usage = {rid: ["ok"] for rid in ("r1", "r2", "r3", "r3b", "r5", "r6", "r7")}
    out = tally(requests, {0: 4.0}, accepted, usage)
    assert out.answered == 2
    assert out.answered_after_ingress_died == 1
    assert out.failed == {"504 x": 1}
    assert [line.split(" ")[0] for line in out.lost] == ["r4", "r5", "r6", "r7"]
    assert "its ingress died and no usage event" in out.lost[0]
    assert "client saw transport" in out.lost[1]
    assert out.usage_missing == ["r4"]
    assert out.clients_retried == 1
    assert out.clients_without_answer == 4
    assert out.unanswered == {"504 x": 1, "transport": 2, "timeout": 1}
    assert "never answered | 6 / 1 / 4 (transport × 2, 504 x × 1, timeout × 1)" in (
        tally_table(out)
    )
    assert not out.target_met


def test_an_answered_request_billed_as_a_drop_fails_the_drill() -> None:
    # Its worker answered it and died before its usage event was stored; the request's
    # re-run found it past its deadline: the only event says expired, no tokens.
    requests = [
        _request("c-1", _attempt("answered", "r1")),
        _request("c-2", _attempt("answered", "r2")),
    ]
    accepted = [Accepted("r1", "c-1", "completion"), Accepted("r2", "c-2", "completion")]
    out = tally(requests, {}, accepted, {"r1": ["ok"], "r2": ["expired", "ok"]})
    assert out.usage_not_ok == ["r2 (c-2): answered, billed expired"]
    assert not out.target_met
    assert "| answered requests whose counted usage event is not ok | 1 | 0 | FAIL |" in (
        tally_table(out)
    )
    assert tally(requests, {}, accepted, {"r1": ["ok"], "r2": ["ok", "expired"]}).target_met


def test_batch_results_beyond_one_per_line_and_doubled_usage_are_counted() -> None:
    ids = {f"batch-j-l{i}": ["ok"] for i in range(3)}
    ids["batch-j-l0"] = ["ok", "ok"]  # a re-run after a crash: reported, not failed
    ids["batch-j-l1"] = ["ok", "error"]
    lines = [f"batch-j-l{i}" for i in range(3)]
    out = tally([], {}, [], ids, lines=lines, results=lines)
    assert (out.batch_duplicates, out.batch_missing, out.usage_missing) == (0, [], [])
    assert out.usage_twice == ["batch-j-l0", "batch-j-l1"]
    assert out.usage_extra == 2
    assert out.usage_conflicting == ["batch-j-l1: ok, error"]
    assert out.target_met
    lines = ["batch-j-l0", "batch-j-l1", "batch-j-l9"]
    twice = tally([], {}, [], ids, lines=lines, results=["batch-j-l0", "batch-j-l0"])
    assert twice.batch_duplicates == 1
    assert twice.batch_missing == ["batch-j-l1", "batch-j-l9"]
    assert twice.usage_missing == ["batch-j-l9"]
    assert not twice.target_met
    table = tally_table(twice)
    assert (
        "| duplicated batch results (beyond one per line) | 1 (2 result records) | 0 | FAIL |"
        in (table)
    )
    assert "| batch lines without a result | 2 of 3 | 0 | FAIL |" in table
    assert "batch lines without a result (2):\n  batch-j-l1\n  batch-j-l9" in details(twice)


def test_batch_tokens_charged_other_than_used_fails_the_drill() -> None:
    def event(team: str, rid: str, prompt: int, completion: int, cls: str = "batch") -> TopicRecord:
        fields = {"team": team, "id": rid, "class": cls, "prompt_tokens": prompt}
        return ("laneway.usage", orjson.dumps({**fields, "completion_tokens": completion}))

    records = [
        event("a", "l0", 10, 24),
        event("a", "l0", 10, 24),  # its re-run: charged once
        event("a", "l1", 0, 0),  # failed before it used a token: the minimum charge
        event("b", "l0", 7, 24),  # the other team's line of the same id
        event("a", "c0", 99, 99, cls="chat"),  # not a batch pool's
        event("z", "l0", 99, 99),  # not a team of the drill
    ]
    used = batch_tokens_used(records, ("a", "b"), min_charge=16)
    assert used == {"a": 34 + 16, "b": 31}
    out = tally([], {}, [], {}, batch_tokens=used)
    assert out.target_met  # unread: nothing to compare
    out.batch_tokens_charged = {"a": 50, "b": 31}
    assert out.target_met
    assert "| a 50 / 50, b 31 / 31 | equal | PASS |" in tally_table(out)
    out.batch_tokens_charged = {"a": 84, "b": 31}  # a line charged twice
    assert not out.target_met
    assert "| a 84 / 50, b 31 / 31 | equal | FAIL |" in tally_table(out)
    out.batch_tokens_charged = {"a": 84, "b": -3}  # one team's excess, another's shortfall
    assert out.batch_charge_off == 34 + 34
    assert not out.target_met


def test_usage_the_rollups_count_other_than_once_per_request_fails_the_drill() -> None:
    usage = {"r1": ["ok"], "r2": ["ok", "ok"], "r3": ["ok"]}
    accepted = [Accepted(rid, rid, "completion") for rid in usage]
    answered = [_request(rid, _attempt("answered", rid)) for rid in usage]
    records = [
        ("laneway.usage", orjson.dumps({"id": rid, "team": "t", "class": "completion"}))
        for rid, statuses in usage.items()
        for _ in statuses
    ]
    with_usage = ids_with_usage(records, ("t",))
    assert with_usage == {"completion": 3}

    def rollup(cls: str, hour: int, requests: int) -> TopicRecord:
        value = {"team": "t", "class": cls, "model": "m", "hour": hour, "requests": requests}
        return ("laneway-streams-rollups-changelog", orjson.dumps(value))

    # The last value of each hour's rollup counts; other teams' are not the drill's.
    changelog = [rollup("completion", 7, 1), rollup("completion", 7, 2), rollup("completion", 8, 1)]
    changelog.append(("x", orjson.dumps({"team": "u", "class": "completion", "requests": 9})))
    counted = rollup_requests(changelog, ("t",))
    assert counted == {"completion": 3}
    out = tally(answered, {}, accepted, usage, with_usage=with_usage, rollups=counted)
    assert (out.usage_counted_twice, out.usage_uncounted, out.usage_extra) == (0, 0, 1)
    assert out.target_met
    twice = tally(
        answered, {}, accepted, usage, with_usage=with_usage, rollups=Counter(completion=4)
    )
    assert (twice.usage_counted_twice, twice.usage_uncounted) == (1, 0)
    assert not twice.target_met
    assert (
        "| usage counted twice (streams rollups: requests beyond one per id) | 1 (4 counted, "
        "3 ids) | 0 | FAIL |" in tally_table(twice)
    )
    short = tally(answered, {}, accepted, usage, with_usage=with_usage, rollups=Counter(chat=3))
    assert (short.usage_counted_twice, short.usage_uncounted) == (3, 3)
    assert "by class: chat 3 counted / 0 ids, completion 0 counted / 3 ids" in details(short)
    unread = tally(answered, {}, accepted, usage, with_usage=with_usage)
    assert unread.usage_uncounted == 3
    assert (
        "| usage counted twice (streams rollups: requests beyond one per id) | not read | 0 "
        "| FAIL |" in tally_table(unread)
    )


def test_the_balancer_skips_a_replica_taken_out() -> None:
    balancer = Balancer(["http://a", "http://b"])
    assert [balancer.pick(n) for n in range(3)] == [0, 1, 0]
    assert balancer.pick(0, avoid=0) == 1
    balancer.mark_down(1)
    assert [balancer.pick(n) for n in range(2)] == [0, 0]
    balancer.mark_down(0)
    assert balancer.pick(0) is None


def _fake_ingress(request: httpx.Request) -> httpx.Response:
    """Ingress a (port 1) breaks every connection; ingress b answers as laneway does."""
    if request.url.host == "a":
        raise httpx.RemoteProtocolError("peer closed connection", request=request)
    text = request.content.decode()
    headers = {"x-laneway-request-id": "rid-" + (tag_of(text) or "?")}
    if "/chat/" not in request.url.path:
        if "c-1" in text:
            return httpx.Response(504, json={"error": {"code": "deadline_exceeded"}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]}, headers=headers)
    chunks = ['{"choices": [{"delta": {"content": "hi"}, "finish_reason": null}]}']
    if "h-1" in text:
        chunks.append('{"error": {"code": "error", "message": "the answer has a hole"}}')
    elif "h-2" in text:
        pass  # cut before the end: no [DONE]
    else:
        chunks.append('{"choices": [{"delta": {}, "finish_reason": "stop"}]}')
    if "h-2" not in text:
        chunks.append("[DONE]")
    body = "".join(f"data: {c}\n\n" for c in chunks)
    return httpx.Response(200, text=body, headers=headers)


async def test_the_clients_record_what_they_saw_and_retry_elsewhere() -> None:
    clients = ChaosClients(
        ["http://a", "http://b"], "k", started=0.0, transport=httpx.MockTransport(_fake_ingress)
    )
    try:
        for n in range(3):
            await clients.completion(n, 0.0)
            await clients.chat(n, 0.0)
    finally:
        await clients.aclose()
    seen = {
        r.tag: [(a.ingress, a.outcome, a.request_id, a.detail) for a in r.attempts]
        for r in clients.requests
    }
    assert seen["c-0"] == [
        (0, "transport", None, "RemoteProtocolError"),
        (1, "answered", "rid-c-0", ""),
    ]
    assert seen["c-1"] == [(1, "failed", None, "deadline_exceeded")]
    assert seen["h-0"] == [(1, "answered", "rid-h-0", "")]
    assert seen["h-1"] == [(1, "failed", "rid-h-1", "error")]
    # A stream without [DONE] broke: no replica is left to try.
    assert seen["h-2"] == [(1, "transport", "rid-h-2", "RemoteProtocolError")]
    assert clients.balancer.down == {0, 1}


def test_a_plan_that_cannot_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="--batch-lines must be at least 1, not 0"):
        ChaosPlan(batch_lines=0)
    with pytest.raises(ConfigError, match="--lean-lines must be at least 1, not -3"):
        ChaosPlan(lean_lines=-3)
    with pytest.raises(ConfigError, match="--gap-s must be above 0"):
        ChaosPlan(gap_s=0)


def test_the_cli_names_a_bad_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, occupied_port: int
) -> None:
    assert main(["drill", "chaos", "--base-port", "80"]) == 2
    assert "--base-port must be within 1024..65508, not 80" in capsys.readouterr().err
    assert main(["drill", "chaos", "--base-port", str(occupied_port)]) == 2
    # Named first (other programs may hold more of the block's ports).
    assert f"--base-port {occupied_port}: ports [{occupied_port}" in capsys.readouterr().err
    (tmp_path / "old").write_text("from an earlier run")
    free = _free_block()
    assert main(["drill", "chaos", "--base-port", str(free), "--data-dir", str(tmp_path)]) == 2
    assert f"--data-dir {tmp_path} is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["drill", "chaos", "--shortt"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --shortt" in capsys.readouterr().err


def _free_block() -> int:
    """A base port whose whole block (every port the topology uses) is free."""
    width = TopologyPlan().last_port - TopologyPlan().base_port + 1
    # Below the ephemeral range, as the default: clients' connections take ports there.
    for base in range(24100, 26300 - width, width):
        if not any(port_in_use(p) for p in range(base, base + width)):
            return base
    raise RuntimeError("no free block of ports in 24100..26299")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_short_chaos_drill_loses_and_duplicates_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(
        [
            "drill",
            "chaos",
            "--short",
            "--base-port",
            str(_free_block()),
            "--data-dir",
            str(tmp_path / "chaos"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # Nothing lost, twice or missing: of something (a drill that counted nothing says 0 of 0).
    for row in (
        r"\| \*\*lost\*\* \(accepted, never answered nor explicitly failed\) \| 0 of [1-9]",
        r"\| batch lines without a result \| 0 of [1-9]",
        r"\| duplicated batch results \(beyond one per line\) \| 0 \([1-9]\d* result records",
        r"\| usage events missing \(accepted, no usage event\) \| 0 \([1-9]\d* events read",
    ):
        assert re.search(row, out), (row, out)
    # The over-budget team's lines waited for its budget through the faults, then ran.
    assert re.search(r"chaos-lean's budget raised: its [1-9]\d* waiting lines may run", out), out
    # Every fault happened while the load ran.
    for fault in ("SIGKILL worker-chat", "SIGSTOP worker-batch", "SIGKILL broker", "SIGKILL Redis",
                  "SIGKILL ingress-1"):  # fmt: skip
        assert fault in out
