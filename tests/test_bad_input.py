"""Every door answers bad input with an error that names the problem, and keeps serving."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from ingress.settings import IngressSettings
from laneway.errors import BadRequest, ConfigError
from laneway.openai_api import CompletionRequest, parse_body
from laneway.settings import CommonSettings, load_settings
from ops.cli import main as cli_main
from ops.drills.topology import TopologyPlan
from ops.settings import StackSettings
from ops.stack_processes import stack_processes
from streams.settings import StreamsSettings
from tests.stack import ROOT, LiveStack, free_port
from workers import metrics
from workers.settings import WorkerSettings


@pytest.fixture
async def ingress_and_key(stack: LiveStack) -> tuple[LiveStack, str]:
    await stack.start_ingress(max_prompt_tokens=1000)
    await stack.start_worker("completion")
    return stack, await stack.api_key("team-a")


def _error(response: object) -> dict[str, object]:
    body = orjson.loads(response.content)  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        (b'{"model": "laneway-code"}', 400, "prompt", "Field required"),
        (
            b'{"model": "laneway-code", "prompt": "x", "max_tokens": "many"}',
            400,
            "max_tokens",
            "integer",
        ),
        # Types as OpenAI takes them: no number or string passes for a flag, nor a flag or a
        # string for a number.
        (b'{"model": "laneway-code", "prompt": "x", "stream": 1}', 400, "stream", "boolean"),
        (b'{"model": "laneway-code", "prompt": "x", "max_tokens": true}', 400, "max_tokens", "int"),
        (b'{"model": "laneway-code", "prompt": "x", "max_tokens": "8"}', 400, "max_tokens", "int"),
        (b'{"model": "laneway-code", "prompt": "x", "top_p": "1"}', 400, "top_p", "number"),
        # Beyond 64 bits JSON parsers read a float: the message says what was sent.
        (
            b'{"model": "laneway-code", "prompt": "x", "max_tokens": 1' + b"0" * 30 + b"}",
            400,
            "max_tokens",
            "expected an integer, got 1e+30",
        ),
        (
            b'{"model": "laneway-code", "prompt": "x", "temperature": 9}',
            400,
            "temperature",
            "less than",
        ),
        (b'{"model": "gpt-nope", "prompt": "x"}', 404, "model", "not served"),
        # JSON laneway could not write out again: refused at the door, naming the field.
        (
            b'{"model": "laneway-code", "prompt": "x", "tools": ' + b"[" * 300 + b"]" * 300 + b"}",
            400,
            "tools",
            "nested more than 64 levels deep",
        ),
        # Costly to decode (100,000 lists): refused before it is decoded, whatever its field.
        (
            b'{"model": "laneway-code", "prompt": "x", "junk": ['
            + b",".join([b"[]"] * 100_000)
            + b"]}",
            400,
            None,
            "more than 50,000 JSON values",
        ),
        (
            b'{"model": "laneway-code", "prompt": "' + b"x" * 8000 + b'"}',
            400,
            "prompt",
            "maximum context length is 1000 tokens (LANEWAY_MAX_PROMPT_TOKENS)",
        ),
    ],
)
async def test_bad_completion_bodies(
    ingress_and_key: tuple[LiveStack, str], body: bytes, status: int, param: str | None, words: str
) -> None:
    stack, key = ingress_and_key
    http = stack.http(stack.ingresses[0], key)
    response = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["param"] == param
    assert words in str(error["message"])


async def test_a_prompt_cut_in_the_middle_of_an_emoji_is_served(
    ingress_and_key: tuple[LiveStack, str],
) -> None:
    """JavaScript's JSON.stringify writes half a surrogate pair as an escape (a plugin that
    cuts its prompt inside an emoji sends one): the half is read as U+FFFD, not refused."""
    stack, key = ingress_and_key
    http = stack.http(stack.ingresses[0], key)
    raw = b'{"model": "laneway-code", "prompt": "# ok \\ud83d", "max_tokens": 4, "seed": -1}'
    response = await http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    # Anything else that is not JSON is still refused as such.
    for bad in (raw.replace(b"4,", b"NaN,"), raw[:-1]):
        refused = await http.post(
            "/v1/completions", content=bad, headers={"content-type": "application/json"}
        )
        assert refused.status_code == 400, bad
        assert "not valid JSON" in str(_error(refused)["message"])


def test_half_a_surrogate_pair_is_read_as_a_replacement_character() -> None:
    body = parse_body(
        CompletionRequest, b'{"model": "m", "prompt": "a\\ud83d b \\ud83d\\ude00 \\udc00"}'
    )
    assert body.prompt == "a\ufffd b \U0001f600 \ufffd"
    # Only that fault: a body in UTF-16, surrogates written as bytes, a number beyond a
    # double or a seed below -1 is refused as it was.
    for raw in (
        '{"model": "m", "prompt": "\\ud83d"}'.encode("utf-16"),
        b'{"model": "m", "prompt": "a\xed\xa0\x80 \\ud83d"}',
        b'{"model": "m", "prompt": "\\ud83d", "prompt_cache_options": {"x": 1e400}}',
        b'{"model": "m", "prompt": "\\ud83d", "seed": -2}',
    ):
        with pytest.raises(BadRequest):
            parse_body(CompletionRequest, raw)
    assert parse_body(CompletionRequest, b'{"model": "m", "prompt": "", "seed": -1}').seed is None


async def test_bad_chat_message_names_the_field(ingress_and_key: tuple[LiveStack, str]) -> None:
    stack, key = ingress_and_key
    http = stack.http(stack.ingresses[0], key)
    response = await http.post(
        "/v1/chat/completions",
        json={"model": "laneway-chat", "messages": [{"role": "user", "content": 5}]},
    )
    assert response.status_code == 400
    assert str(_error(response)["param"]).startswith("messages.0.content")


@pytest.mark.parametrize("header", [None, "Bearer lw-not-a-key", "Basic abc"])
async def test_unknown_key_is_401(
    ingress_and_key: tuple[LiveStack, str], header: str | None
) -> None:
    stack, _ = ingress_and_key
    http = stack.http(stack.ingresses[0])
    headers = {"Authorization": header} if header else {}
    response = await http.post(
        "/v1/completions", json={"model": "laneway-code", "prompt": "x"}, headers=headers
    )
    assert response.status_code == 401
    assert _error(response)["type"] == "authentication_error"


async def test_bad_header_is_named(ingress_and_key: tuple[LiveStack, str]) -> None:
    stack, key = ingress_and_key
    http = stack.http(stack.ingresses[0], key)
    response = await http.post(
        "/v1/completions",
        json={"model": "laneway-code", "prompt": "x"},
        headers={"X-Laneway-Seq": "seven"},
    )
    assert response.status_code == 400
    assert _error(response)["param"] == "x-laneway-seq"


async def test_a_repeated_key_or_session_header_is_refused(
    ingress_and_key: tuple[LiveStack, str],
) -> None:
    """Which of two keys a proxy, the ingress and a log each read could differ."""
    stack, key = ingress_and_key
    other = await stack.api_key("team-b")
    http = stack.http(stack.ingresses[0])
    body = {"model": "laneway-code", "prompt": "x"}
    for name, values in (
        ("authorization", [f"Bearer {other}", f"Bearer {key}"]),
        ("x-laneway-session", ["a.py", "b.py"]),
    ):
        headers = [(name, value) for value in values]
        if name != "authorization":
            headers.append(("authorization", f"Bearer {key}"))
        response = await http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 400, response.text
        error = _error(response)
        assert (error["param"], "sent 2 times" in str(error["message"])) == (name, True)
    # The same value twice (a proxy that adds it again) reads one way only.
    twice = [("authorization", f"Bearer {key}")] * 2 + [("x-laneway-session", "a.py")] * 2
    assert (await http.post("/v1/completions", json=body, headers=twice)).status_code == 200


async def test_malformed_kafka_records_are_skipped(ingress_and_key: tuple[LiveStack, str]) -> None:
    stack, key = ingress_and_key
    worker = stack.workers[0]
    producer = await stack.producer()
    topic = stack.topics.request("completion", "hi")

    def skipped() -> float:
        return metrics.MALFORMED.labels("completion", topic)._value.get()

    before = skipped()
    for junk in (b"\x00\xff not json", b'{"v": 1, "id": "x"}', b"[]"):
        for partition in (0, 1):
            await producer.send_and_wait(topic, junk, partition=partition)
    http = stack.http(stack.ingresses[0], key)
    # The worker is still serving after the junk: requests on both partitions complete.
    for prompt in ("first", "second", "third", "fourth"):
        response = await http.post(
            "/v1/completions", json={"model": "laneway-code", "prompt": prompt}
        )
        assert response.status_code == 200, response.text
    for _ in range(100):
        if skipped() - before >= 6:
            break
        await asyncio.sleep(0.05)
    assert skipped() - before == 6
    assert not worker._stopping.is_set()


def test_misspelt_setting_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_KAFKA_BOOTSTRAPP", "127.0.0.1:1")
    with pytest.raises(ConfigError, match="LANEWAY_KAFKA_BOOTSTRAPP"):
        load_settings(IngressSettings)


def test_a_retired_setting_names_its_successor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_BATCH_MEMORY_HIGH", "0.9")
    with pytest.raises(
        ConfigError, match="LANEWAY_BATCH_MEMORY_HIGH is now LANEWAY_MEMORY_SHED_AT"
    ):
        load_settings(WorkerSettings)


def test_bad_setting_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_MAX_INFLIGHT", "-3")
    with pytest.raises(ConfigError, match="LANEWAY_MAX_INFLIGHT"):
        load_settings(WorkerSettings)


def test_a_guessable_admin_key_is_refused_and_the_value_not_echoed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admin key is tried against the admin API, the console and /readyz by whoever
    reaches a replica, at any rate: a short one could be guessed."""
    monkeypatch.setenv("LANEWAY_ADMIN_KEY", "hunter2")
    with pytest.raises(ConfigError, match=r"LANEWAY_ADMIN_KEY.*7 characters, under the 16") as e:
        load_settings(IngressSettings)
    assert "hunter2" not in str(e.value)
    monkeypatch.setenv("LANEWAY_ADMIN_KEY", "")
    assert not load_settings(IngressSettings).admin_key.get_secret_value()  # off
    monkeypatch.setenv("LANEWAY_ADMIN_KEY", "x" * 16)
    assert load_settings(IngressSettings).admin_key.get_secret_value() == "x" * 16
    # A team's key's prefix: never judged as the admin key, so it could never be used.
    monkeypatch.setenv("LANEWAY_ADMIN_KEY", "lw-" + "x" * 30)
    with pytest.raises(ConfigError, match=r"LANEWAY_ADMIN_KEY.*starts with 'lw-'"):
        load_settings(IngressSettings)


def test_a_shared_upstream_without_its_slots_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Learned from one worker's first bytes, a shared engine's slots stayed where they
    started: batch ran 3 lines at a time on a server that takes hundreds, and nothing said
    why. The worker refuses to start instead, naming what to set."""
    monkeypatch.setenv("LANEWAY_POOL", "batch")
    monkeypatch.setenv("LANEWAY_ENGINE", "openai")
    monkeypatch.setenv("LANEWAY_UPSTREAM_URL", "http://gpu-1:8000/v1")
    monkeypatch.setenv("LANEWAY_ENGINE_ID", "gpu-fleet-1")
    with pytest.raises(ConfigError, match=r"LANEWAY_UPSTREAM_SLOTS=0: must be set for a shared"):
        load_settings(WorkerSettings)
    monkeypatch.setenv("LANEWAY_UPSTREAM_SLOTS", "256")
    assert load_settings(WorkerSettings).upstream_slots == 256


def test_a_bad_local_stack_port_is_named_where_it_stands_for_an_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LANEWAY_REDIS_PORT", "16379x")
    with pytest.raises(ConfigError, match="LANEWAY_REDIS_PORT='16379x': not a port number"):
        load_settings(CommonSettings)
    # An address that is set wins over the port, which then stands for nothing here.
    monkeypatch.setenv("LANEWAY_REDIS_URL", "redis://10.0.0.5:6379/0")
    assert load_settings(CommonSettings).redis_url == "redis://10.0.0.5:6379/0"


def test_a_misspelt_setting_is_told_the_name_it_was_meant_to_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LANEWAY_PROT", "9000")
    with pytest.raises(ConfigError, match="LANEWAY_PROT: did you mean LANEWAY_PORT"):
        load_settings(IngressSettings)


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        # pydantic-settings parses JSON before validation: its error named no variable.
        ("LANEWAY_MODELS", "[not json", "LANEWAY_MODELS: not valid JSON"),
        # Passed before, then int(inf) failed every admission.
        ("LANEWAY_QUOTA_UNITS_PER_MEMBER", "inf", "finite number"),
        ("LANEWAY_QUOTA_BATCH_RATIO", "nan", "finite number"),
        ("LANEWAY_PRICES", '{"*": {"prompt": 1e999}}', "LANEWAY_PRICES.*.PROMPT"),
        # Without '*', every route it did not name (a canary, a fallback) cost 0, unsaid.
        ("LANEWAY_PRICES", '{"laneway-code": {"prompt": 1}}', "needs a '*' entry"),
        # A misspelt breaker level left that level on the model itself.
        ("LANEWAY_BREAKER_ROUTES", '{"m": {"quantised": "m-q"}}', "quantised is not"),
        ("LANEWAY_REDIS_URL", "redis://u:hunter2@h:notaport/0", "not a Redis URL"),
        ("LANEWAY_REDIS_URL", "notaurl", "not a Redis URL"),
    ],
)
def test_a_setting_laneway_cannot_use_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, words: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as refused:
        load_settings(IngressSettings)
    assert variable in str(refused.value)
    assert words in str(refused.value)
    assert "hunter2" not in str(refused.value)  # a Redis URL may hold a password


@pytest.mark.parametrize(
    ("variable", "cls"),
    [
        ("LANEWAY_PRICES", StreamsSettings),
        ("LANEWAY_MODELS", IngressSettings),
        ("LANEWAY_BREAKER_ENTER", StreamsSettings),
        ("LANEWAY_LOCAL_REPLICAS", StackSettings),
    ],
)
def test_a_json_null_is_refused_not_taken_for_the_default(
    monkeypatch: pytest.MonkeyPatch, variable: str, cls: type[Any]
) -> None:
    """pydantic-settings drops a null: the default stood, as if the variable were unset."""
    monkeypatch.setenv(variable, "null")
    with pytest.raises(ConfigError, match=f"{variable}=null: null is no value here"):
        load_settings(cls)


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("ops.cli.cmd_topics_create", interrupted)
    assert cli_main(["topics", "create"]) == 130
    err = capsys.readouterr().err
    assert err == "laneway: interrupted\n"


def test_a_heartbeat_slower_than_liveness_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_HEARTBEAT_INTERVAL_S", "7")  # beats counted live for 6 s
    with pytest.raises(ConfigError, match="LANEWAY_HEARTBEAT_INTERVAL_S"):
        load_settings(WorkerSettings)


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("LANEWAY_MAX_INFLIGHT", "abc", "worker-completion: bad setting: LANEWAY_MAX_INFLIGHT"),
        ("LANEWAY_BREAKER_ENTER", "[0.5, 0.1, 0.2]", "streams: bad setting"),
        ("LANEWAY_BREAKER_ENTER", "[0.1, 0.1, 0.1]", "must rise"),  # three levels in one
        ("LANEWAY_SUPERVISOR_PORT", "8000", "LANEWAY_PORT and LANEWAY_SUPERVISOR_PORT"),
        ("LANEWAY_REDIS_PORT", "19093", "Kafka controller) and LANEWAY_REDIS_PORT"),
        ("LANEWAY_METRICS_PORT", "9100", "that one port"),
        ("LANEWAY_ENGINE", "openai", "worker-completion: bad setting: LANEWAY_ENGINE=openai needs"),
        ("LANEWAY_ENGINE", "vllm", "worker-completion: bad setting: LANEWAY_ENGINE=vllm needs"),
        ("LANEWAY_STREAMS_PARTITIONS", "2", "streams: LANEWAY_STREAMS_PARTITIONS=2, but"),
        ("LANEWAY_HOST", "abc.invalid", "ingress: LANEWAY_HOST='abc.invalid' is not an address"),
    ],
)
def test_laneway_up_refuses_what_a_service_would_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, value: str, words: str
) -> None:
    """Each of these passed `laneway up`'s own settings and failed later, after Kafka and
    Redis had started, as a service's crash loop."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=re.escape(words)):
        stack_processes(load_settings(StackSettings, data_dir=str(tmp_path / "stack")))
    assert not (tmp_path / "stack").exists()


def test_laneway_up_says_it_does_not_use_the_shells_kafka_and_redis(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LANEWAY_REDIS_URL", "redis://:hunter2@elsewhere:6379/0")
    monkeypatch.setenv("LANEWAY_KAFKA_BOOTSTRAP", "elsewhere:9092")
    with caplog.at_level(logging.WARNING, logger="ops.stack_processes"):
        stack_processes(load_settings(StackSettings, data_dir=str(tmp_path / "stack")))
    said = [r.getMessage() for r in caplog.records]
    assert any("LANEWAY_REDIS_URL is set in this shell" in m for m in said), said
    assert any("LANEWAY_KAFKA_BOOTSTRAP is set in this shell" in m for m in said), said
    assert "hunter2" not in caplog.text


def _python(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``python argv`` from the repository root with ``env``; its output, whatever its exit."""
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("module", ["ingress", "streams"])
def test_a_service_without_arguments_refuses_one(module: str) -> None:
    """`python -m ingress --port 9000` listened on 8000, and `--help` started the service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
    run = _python(env, "-m", module, "--port", "9000")
    assert run.returncode == 2
    assert "unrecognized arguments: --port 9000" in run.stderr
    helped = _python(env, "-m", module, "--help")
    assert helped.returncode == 0
    assert "LANEWAY_* environment variables" in helped.stdout


def test_a_service_says_in_a_line_that_kafka_did_not_answer() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_")}
    env["LANEWAY_KAFKA_BOOTSTRAP"] = f"127.0.0.1:{free_port()}"
    for argv in (
        ["-m", "ingress"],
        ["-m", "workers", "--pool", "chat"],
        ["-m", "ops.cli", "topics", "create"],
    ):
        run = _python(env, *argv)
        assert run.returncode == 1, (argv, run.stderr)
        assert f"Kafka at {env['LANEWAY_KAFKA_BOOTSTRAP']} did not answer" in run.stderr, argv
        assert "Traceback" not in run.stderr, (argv, run.stderr)
        assert "Unclosed" not in run.stderr, (argv, run.stderr)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["keys", "revoke", ""], "name the key to revoke"),
        (["keys", "create", "--team", "   "], "team name is empty"),
        (["usage", "tail", "--limit", "-1"], "--limit: -1 is not from 1"),
        (["topics", "create", "--partitions", "100000"], "--partitions: 100000 is not from 0"),
        (["drill", "canary", "--rps", "nan"], "--rps: not a finite number"),
        (["drill", "canary", "--key", "k", "--rps", "-2"], "at least 1, not -2 and"),
        (["drill", "surge", "--surge-s", "inf"], "--surge-s: not a finite number"),
        (["batch", "results", "j", "-o", "/"], "/ is a directory"),
        (["batch", "results", "j", "-o", "/no/such/dir/out.jsonl"], "no directory /no/such/dir"),
        (["drill", "chaos", "--data-dir", __file__], "is a file"),
        # Refused before the job is sent, not a job left running and "not done after -5s".
        (["batch", "submit", __file__, "--wait", "--timeout", "-5"], "-5 is not above 0"),
    ],
)
def test_the_cli_refuses_bad_arguments_before_reaching_a_server(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each passed and then failed against a server, or after minutes, or not at all."""
    try:
        code = cli_main(argv)
    except SystemExit as exit_:  # argparse's own usage error
        code = int(exit_.code or 0)
    assert code == 2
    assert words in capsys.readouterr().err


def test_the_chaos_drill_names_the_ports_another_program_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its topology binds a fixed range: a taken port is named before anything starts."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        span = TopologyPlan().last_port - TopologyPlan().base_port
        base = max(1024, taken - span)
        code = cli_main(
            ["drill", "chaos", "--base-port", str(base), "--data-dir", str(tmp_path / "run")]
        )
    assert code == 2
    err = capsys.readouterr().err
    assert "are taken; choose another base" in err
    assert str(taken) in err.split("ports [")[1].split("]")[0].split(", ")
    assert not (tmp_path / "run").exists()
