"""Tenant boundaries at the HTTP door, on the real stack: sessions belong to their team,
``X-Laneway-*`` headers are bounded, bodies are limited, cancels are rate-limited per team,
and nothing internal leaks into a response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from ingress.cancels import CancelOutbox
from ingress.metrics import CLIENT_GONE, RESPONSES
from laneway.constants import RedisKeys
from laneway.schema import CancelRecord
from tests.stack import (
    LiveStack,
    envelope,
    eventually,
    free_port,
    status_before_the_body_ends,
)
from tests.tcp_proxy import TcpProxy
from tests.test_wire_conformance import _count

BODY = {"model": "laneway-code", "prompt": "def handler(request):", "max_tokens": 8}


def _keystroke(session: str, seq: int) -> dict[str, str]:
    return {"X-Laneway-Session": session, "X-Laneway-Seq": str(seq)}


async def test_another_teams_seq_of_the_same_session_supersedes_nothing(stack: LiveStack) -> None:
    """The issue's case: team A's seq 999999999 on src/app.py used to make every completion
    of team B on a session of that name a 409, telling B A's counter."""
    ingress = await stack.start_ingress()
    await stack.start_worker("completion")
    a = stack.http(ingress, await stack.api_key("team-a"))
    b = stack.http(ingress, await stack.api_key("team-b"))
    first = await a.post("/v1/completions", json=BODY, headers=_keystroke("src/app.py", 999999999))
    assert first.status_code == 200, first.text

    served = []
    for seq in (1, 2, 3):
        response = await b.post("/v1/completions", json=BODY, headers=_keystroke("src/app.py", seq))
        assert response.status_code == 200, response.text
        assert "999999999" not in response.text
        served.append(response.json()["id"])

    # Within a team the session still supersedes: A's own older keystroke is dropped.
    stale = await a.post("/v1/completions", json=BODY, headers=_keystroke("src/app.py", 5))
    assert stale.status_code == 409, stale.text
    assert stale.json()["error"]["code"] == "superseded"
    events = await stack.read_topic(
        stack.topics.usage, count=len(served), where=lambda e: e["id"] in served
    )
    assert sorted((e["team"], e["status"]) for e in events) == [("team-b", "ok")] * 3


@pytest.mark.parametrize(
    ("header", "value", "words"),
    [
        ("X-Laneway-Seq", "-1", "from 0 to"),
        ("X-Laneway-Seq", "+5", "whole number"),
        ("X-Laneway-Seq", "1_000", "whole number"),
        ("X-Laneway-Seq", str(2**63), str(2**63 - 1)),
        ("X-Laneway-Seq", "9" * 5000, "whole number"),
        ("X-Laneway-Session", "s" * 257, "1 to 256"),
        ("X-Laneway-Session", "", "1 to 256"),
        ("X-Laneway-Session", "src/\tapp.py", "control characters"),
        ("X-Laneway-Deadline-Ms", "0", "from 1 to"),
        ("X-Laneway-Deadline-Ms", "99999999999", "from 1 to"),
        ("X-Laneway-Priority", "urgent", "'hi' or 'lo'"),
    ],
)
async def test_bad_laneway_headers_are_400s_that_name_the_header(
    stack: LiveStack, header: str, value: str, words: str
) -> None:
    ingress = await stack.start_ingress()
    http = stack.http(ingress, await stack.api_key("team-a"))
    response = await http.post("/v1/completions", json=BODY, headers={header: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == header.lower()
    assert header.lower() in error["message"]
    assert words in error["message"]
    assert len(response.content) < 1000  # a bad value is not echoed back whole


async def test_bodies_over_the_limit_get_413_with_the_limit(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(max_body_bytes=4096)
    await stack.start_worker("completion")
    http = stack.http(ingress, await stack.api_key("team-a"))
    big = orjson.dumps({**BODY, "prompt": "x" * 5000})
    response = await http.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    assert "body is 5" in message  # its Content-Length
    assert "over the limit of 4096 bytes (LANEWAY_MAX_BODY_BYTES)" in message

    async def chunks(body: bytes) -> AsyncIterator[bytes]:  # no Content-Length: chunked
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    told, gone = _count(RESPONSES, "completion", "413"), _count(CLIENT_GONE, "completion")
    response = await http.post(
        "/v1/completions", content=chunks(big), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413, response.text
    assert "over the limit of 4096 bytes" in response.json()["error"]["message"]
    # Counted as the 413 it was, not as a client gone (the app was told it left).
    assert _count(RESPONSES, "completion", "413") == told + 1
    assert _count(CLIENT_GONE, "completion") == gone
    # Under the limit, chunked or not, it is served.
    small = orjson.dumps(BODY)
    response = await http.post(
        "/v1/completions", content=chunks(small), headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


async def test_a_chunked_body_without_a_key_is_answered_before_it_ends(
    stack: LiveStack,
) -> None:
    """A chunked body was held whole, up to the limit, before the key was looked at:
    thousands of slow bodies without a key held that much memory each."""
    ingress = await stack.start_ingress()
    start = b'{"model": "laneway-code", "prompt": "'
    status = await status_before_the_body_ends(
        ingress.port, "/v1/completions", "application/json", start
    )
    assert status.split()[1] == b"401", status


async def test_a_body_under_the_limit_too_big_to_queue_is_a_413_not_a_retry(
    stack: LiveStack,
) -> None:
    # 1.5 MB of stop string: under the 2 MiB body limit, over what one Kafka message holds.
    ingress = await stack.start_ingress()
    http = stack.http(ingress, await stack.api_key("team-a"))
    body = {**BODY, "stop": ["s" * 1_500_000]}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 413, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert "more than the request queue takes" in error["message"]
    assert len(response.content) < 1000


async def test_many_short_chat_messages_count_their_framing_against_the_prompt_limit(
    stack: LiveStack,
) -> None:
    # 14,000 one-letter messages: 3,500 tokens of text by the estimate, but each is framed
    # (role, separators) by the chat template, 3 tokens more: 45,503 in all, over the 40,960
    # limit, where the text alone is far under it.
    ingress = await stack.start_ingress()
    http = stack.http(ingress, await stack.api_key("team-a"))
    messages = [{"role": "user", "content": "x"}] * 14_000
    body = {"model": "laneway-chat", "messages": messages, "max_tokens": 1}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text  # as OpenAI answers it
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "maximum context length is 40960 tokens (LANEWAY_MAX_PROMPT_TOKENS)" in error["message"]
    assert "about 45503 tokens by laneway's estimate" in error["message"]


async def test_cancels_by_id_are_rate_limited_per_team(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(cancels_per_s=2)
    a = stack.http(ingress, await stack.api_key("team-a"))
    b = stack.http(ingress, await stack.api_key("team-b"))
    codes = [(await a.delete(f"/v1/requests/cmpl-{i}")).status_code for i in range(12)]
    assert 429 in codes
    assert codes.count(202) >= 2
    refused = await a.delete("/v1/requests/cmpl-x")
    if refused.status_code == 429:  # the second may just have turned
        assert int(refused.headers["retry-after"]) >= 1
        assert "LANEWAY_CANCELS_PER_S" in refused.json()["error"]["message"]
        assert "x-ratelimit-limit-tokens" not in refused.headers
    # Team A's count is not team B's.
    assert (await b.delete("/v1/requests/cmpl-b")).status_code == 202
    too_long = await b.delete("/v1/requests/" + "c" * 2049)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "request_id"


async def test_a_newer_keystroke_of_another_team_never_stands_in_for_a_tombstone(
    stack: LiveStack,
) -> None:
    """A gone client's tombstone is left off Kafka only when a newer seq of the same
    session of the same team was stored: another team's seq of that name is not one."""
    outbox = CancelOutbox(
        await stack.producer(), stack.redis, stack.topics, RedisKeys(stack.prefix), hold_s=0.2
    )
    outbox.start()
    reply_to = f"{stack.prefix}:reply:test"
    try:
        old = envelope(team="team-b", session="doc", seq=1, reply_to=reply_to)
        outbox.accepted(envelope(team="team-a", session="doc", seq=2, reply_to=reply_to))
        outbox.add(old)
        await eventually(lambda: outbox.held == 0, 10, "the hold to end")
        marker = CancelRecord(id="marker-" + old.id, team=old.team)
        await outbox.send_now(marker)
        records = await stack.read_topic(
            stack.topics.cancel, count=2, where=lambda r: r["id"] in (old.id, marker.id)
        )
    finally:
        await outbox.stop()
    assert sorted(r["id"] for r in records) == sorted([old.id, marker.id])


async def test_readyz_says_ready_or_not_and_only_the_admin_sees_why(stack: LiveStack) -> None:
    target = urlsplit(stack.services.redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    try:
        ingress = await stack.start_ingress(redis_url=proxy.url(), admin_key="ops-readyz-admin-key")
        public = stack.http(ingress)
        ready = await public.get("/readyz")
        assert set(ready.json()) == {"ready"}  # no workers here: not ready, and no details
        await proxy.cut_off()
        down = await public.get("/readyz")
        assert set(down.json()) == {"ready"}
        admin = await stack.http(ingress, "ops-readyz-admin-key").get("/readyz")
        checks = admin.json()["checks"]
        assert checks["redis"]["ok"] is False
        assert checks["redis"]["error"].isidentifier()  # the kind of error, not its text
        # A request that needs Redis now: a 503 that names no server and quotes no error.
        response = await stack.http(ingress, "lw-" + "z" * 32).get("/v1/models")
        assert response.status_code == 503
        _assert_nothing_internal(response.text, proxy.port)
    finally:
        await proxy.stop()


async def test_an_engine_failure_reaches_the_client_without_its_internals(
    stack: LiveStack,
) -> None:
    dead = free_port()  # an upstream that is not there: every request fails in the engine
    ingress = await stack.start_ingress()
    await stack.start_worker(
        "completion",
        engine="openai",
        upstream_url=f"http://127.0.0.1:{dead}/v1",
        upstream_slots=2,
        upstream_metrics_url="",
    )
    http = stack.http(ingress, await stack.api_key("team-a"))
    response = await http.post("/v1/completions", json=BODY)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["type"] == "engine_error"
    _assert_nothing_internal(response.text, dead)
    events = await stack.read_topic(stack.topics.usage, count=1)
    assert events[0]["status"] == "error"
    assert str(dead) in events[0]["error"]  # the operator's record keeps the detail


def _assert_nothing_internal(text: str, port: int) -> None:
    body: dict[str, Any] = orjson.loads(text)
    message = body["error"]["message"].lower()
    for secret in ("127.0.0.1", str(port), "redis", "kafka", "error(", "connection", "errno"):
        assert secret not in message, f"{secret!r} in {message!r}"


async def test_no_api_description_lists_the_admin_routes_to_tenants(stack: LiveStack) -> None:
    ingress = await stack.start_ingress(admin_key="door-admin-key-0123")
    http = stack.http(ingress, await stack.api_key("team-a"))
    for path in ("/openapi.json", "/docs", "/redoc"):
        response = await http.get(path)
        assert response.status_code == 404, path
        assert "/admin" not in response.text
