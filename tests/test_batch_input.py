"""OpenAI Batch input lines as laneway reads them: every line one request, ids as sent."""

from __future__ import annotations

import orjson

from laneway.batch import MAX_CUSTOM_ID_CHARS, parse_input


def _line(custom_id: str) -> str:
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    ).decode()


def test_a_custom_id_too_long_to_keep_is_refused_not_cut() -> None:
    # Two ids that differ only past the limit: cut, they would come back as one id twice.
    long_a = "a" * MAX_CUSTOM_ID_CHARS + "-first"
    long_b = "a" * MAX_CUSTOM_ID_CHARS + "-second"
    exact = "b" * MAX_CUSTOM_ID_CHARS
    lines = list(parse_input([_line(long_a), _line(long_b), _line(exact)], job_id="j", team="t"))
    assert [line.error is None for line in lines] == [False, False, True]
    assert lines[2].line_id == exact  # at the limit: kept whole, runs
    for number, line in enumerate(lines[:2], start=1):
        assert line.line_id.endswith(f"#{number}")  # one id each, saying which line
        assert f"over {MAX_CUSTOM_ID_CHARS}" in (line.error or "")
    assert len({line.line_id for line in lines}) == 3


def test_a_repeated_custom_id_is_refused_under_an_id_of_its_own() -> None:
    lines = list(parse_input([_line("doc"), _line("doc")], job_id="j", team="t"))
    assert [(line.line_id, line.error is None) for line in lines] == [
        ("doc", True),
        ("doc#2", False),
    ]
    assert "repeats an earlier line" in (lines[1].error or "")
