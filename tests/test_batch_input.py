"""OpenAI Batch input lines as laneway reads them: every line one request, ids as sent."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from laneway.batch import MAX_CUSTOM_ID_CHARS, MAX_LINE_BYTES, parse_input
from laneway.errors import BadRequest, ConfigError
from ops.batch_cli import _jsonl_lines


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


def _bare(content: str = "hi") -> str:
    """A line without a custom_id: laneway makes one up."""
    body = {"model": "laneway-chat", "messages": [{"role": "user", "content": content}]}
    return orjson.dumps({"method": "POST", "url": "/v1/chat/completions", "body": body}).decode()


def test_every_line_comes_back_under_an_id_of_its_own() -> None:
    # Results are matched to lines by id: two lines under one id would leave the job
    # forever one line short. Made-up ids ("line-N", "x#N") must not take an id another
    # line of the file was sent with, before or after it.
    lines = [
        _bare(),  # 1: made up "line-1", but line 4 claims it
        "{not json",  # 2: made up "line-2", but line 5 claims it
        _line("doc"),  # 3
        _line("line-1"),  # 4
        _line("line-2"),  # 5
        _line("doc"),  # 6: repeats line 3; "doc#6" is claimed by line 7
        _line("doc#6"),  # 7
        _bare(),  # 8: "line-8" is free
    ]
    parsed = list(parse_input(lines, job_id="j", team="t"))
    ids = [line.line_id for line in parsed]
    assert len(set(ids)) == len(ids) == 8, ids
    # Every id a line was sent with and could keep is kept, and that line runs.
    by_id = {line.line_id: line for line in parsed}
    for kept in ("doc", "line-1", "line-2", "doc#6"):
        assert by_id[kept].error is None, kept
    assert by_id["line-8"].error is None
    assert parsed[1].error is not None
    assert "invalid JSON" in parsed[1].error
    assert parsed[5].error is not None
    assert "repeats an earlier line" in parsed[5].error


def test_a_line_read_once_from_an_iterator_is_parsed_like_a_list() -> None:
    lines = [_bare(), _line("line-1")]
    from_list = [line.line_id for line in parse_input(lines, job_id="j", team="t")]
    from_iter = [line.line_id for line in parse_input(iter(lines), job_id="j", team="t")]
    assert from_list == from_iter
    assert len(set(from_list)) == 2


def test_made_up_ids_stay_within_the_limit_whatever_the_file_claims() -> None:
    # A file whose ids claim each made-up id in turn: the next one is still short enough.
    base = "a" * 480
    lines = [_line(base), _line(base)] + [_line(f"{base}#2" + "#2" * n) for n in range(12)]
    lines += [_line(f"{base}#2~{k}") for k in range(2, 6)]
    parsed = list(parse_input(lines, job_id="j", team="t"))
    ids = [line.line_id for line in parsed]
    assert len(set(ids)) == len(ids)
    assert max(len(line_id) for line_id in ids) <= MAX_CUSTOM_ID_CHARS


def test_a_custom_id_written_with_escapes_is_still_claimed() -> None:
    # "custom\u005fid" is the key custom_id: its id is the line's, not a made-up one's.
    escaped = '{"custom\\u005fid": "line-1", "method": "POST", "url": "/v1/completions", '
    escaped += '"body": {"model": "laneway-code", "prompt": "x"}}'
    parsed = list(parse_input([_bare(), escaped], job_id="j", team="t"))
    assert parsed[1].line_id == "line-1"
    assert parsed[1].error is None
    assert parsed[0].line_id != "line-1"


def test_a_body_laneway_could_not_write_out_again_is_an_error_line() -> None:
    """Nesting past the limit (orjson and pydantic refuse 255 levels when the line is
    written to Kafka): the line is answered with the problem, the others run."""
    deep = "[" * 300 + '"hi"' + "]" * 300  # written by hand: orjson itself would refuse it
    line = '{"custom_id": "deep", "url": "/v1/chat/completions", "body": {"metadata": %s}}'
    bad, good = parse_input([line % deep, _line("good")], job_id="j", team="t")
    assert (bad.line_id, good.error) == ("deep", None)
    assert "line 1: body.metadata.0.0" in (bad.error or "")
    assert "nested more than 64 levels deep" in (bad.error or "")
    bad.to_json()  # an error line is carried


def test_a_line_that_grows_past_a_record_when_written_is_an_error_line() -> None:
    """The limit is on what goes to Kafka: ``1e15`` is written ``1000000000000000.0``, so a
    line under the limit as sent can be over it as written (the batch's transaction would
    fail, and with it the whole batch, at every try)."""
    numbers = ",".join(["1e15"] * 150_000)
    body = '{"model": "laneway-chat", "messages": [], "metadata": {"n": [' + numbers + "]}}"
    text = '{"custom_id": "big", "url": "/v1/chat/completions", "body": ' + body + "}"
    assert len(text.encode()) < MAX_LINE_BYTES
    bad, good = parse_input([text, _line("good")], job_id="j", team="t")
    assert (bad.line_id, good.error) == ("big", None)
    assert "as written to Kafka" in (bad.error or "")
    assert len(bad.to_json()) < 10_000


def test_an_error_line_quotes_what_was_sent_only_in_part() -> None:
    url = "/v1/" + "x" * 500_000
    line = orjson.dumps({"custom_id": "u", "url": url, "body": {}}).decode()
    (bad,) = parse_input([line], job_id="j", team="t")
    assert "must be one of" in (bad.error or "")
    assert "more characters" in (bad.error or "")
    assert len(bad.to_json()) < 10_000


def test_the_cli_reads_a_jsonl_file_at_newlines_only(tmp_path: Path) -> None:
    """U+2028, NEL and form feeds are text inside a JSON string, not line ends."""
    text = _line("a\u2028b\x85c\x0cd") + "\r\n" + _line("second") + "\n"
    path = tmp_path / "jobs.jsonl"
    path.write_text(text, encoding="utf-8")
    lines = list(parse_input(_jsonl_lines(path), job_id="j", team="t"))
    assert [(line.line_id, line.error) for line in lines] == [
        ("a\u2028b\x85c\x0cd", None),
        ("second", None),
    ]
    path.write_bytes(b'{"custom_id": "\xff"}\n')
    with pytest.raises(BadRequest, match="not UTF-8 text"):
        _jsonl_lines(path)
    with pytest.raises(ConfigError, match="is a directory"):
        _jsonl_lines(tmp_path)
