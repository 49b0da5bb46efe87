"""The console's door over plain HTTP: the login, the session cookie's flags, forms refused
without the session's token or from another site, and the edits reaching Redis and the
request path (the browser tests in test_console_browser.py drive the same pages)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import orjson
import pytest

from ingress.console.feed import ConsoleFeed
from ingress.console.session import COOKIE, ConsoleSessions
from laneway.constants import RedisKeys
from laneway.settings import CommonSettings
from ops.redis_server import RedisServer
from quota.teams import get_team
from tests.stack import (
    Ingress,
    LiveStack,
    Services,
    clear_of_the_hour_turn,
    eventually,
    free_port,
)

ADMIN = "console-admin-key-0123456789"
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def _logged_in(stack: LiveStack, ingress: Ingress) -> tuple[httpx.AsyncClient, str]:
    http = stack.http(ingress, follow_redirects=False)
    response = await http.post("/console/login", data={"admin_key": ADMIN})
    assert response.status_code == 303, response.text
    page = await http.get("/console")
    assert page.status_code == 200
    match = _CSRF.search(page.text)
    assert match is not None, page.text[:500]
    return http, match.group(1)


async def test_the_console_is_off_without_an_admin_key(stack: LiveStack) -> None:
    ingress = await stack.start_ingress()
    response = await stack.http(ingress).get("/console")
    assert response.status_code == 404


async def test_login_sets_a_strict_http_only_session_and_a_wrong_key_gets_none(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    http = stack.http(ingress, follow_redirects=False)
    page = await http.get("/console")
    assert page.status_code == 200
    assert 'name="admin_key"' in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]

    wrong = await http.post("/console/login", data={"admin_key": "not-it"})
    assert wrong.status_code == 401
    assert "set-cookie" not in wrong.headers

    right = await http.post("/console/login", data={"admin_key": ADMIN})
    assert right.status_code == 303
    cookie = SimpleCookie(right.headers["set-cookie"])[COOKIE]
    assert cookie["httponly"] is True
    assert cookie["samesite"] == "strict"
    assert cookie["path"] == "/console"
    assert int(cookie["max-age"]) == 8 * 3600
    assert ADMIN not in right.headers["set-cookie"]
    assert ADMIN not in right.headers.get("location", "")
    overview = await http.get("/console")
    assert 'id="teams"' in overview.text

    # A forged or expired cookie is no session.
    http.cookies.set(COOKIE, cookie.value[:-2] + "xx", path="/console")
    assert 'name="admin_key"' in (await http.get("/console")).text
    expired = ConsoleSessions(ADMIN, 60, clock=lambda: 0.0).issue()
    http.cookies.set(COOKIE, expired, path="/console")
    assert 'name="admin_key"' in (await http.get("/console")).text
    # One that is not even ASCII (a 500 before: compare_digest takes ASCII strings only).
    assert ConsoleSessions(ADMIN, 60).verify("9999999999.a.\xe9") is None


async def test_wrong_admin_keys_past_a_burst_are_not_judged_for_a_while(
    stack: LiveStack,
) -> None:
    """Guessing the admin key at the console, the admin API and /readyz: past 20 wrong
    ones every key is answered 429, the right one too (judging it would tell the guesser),
    until a try is due (one a second)."""
    ingress = await stack.start_ingress(admin_key=ADMIN)
    http = stack.http(ingress, follow_redirects=False)
    # A team's key (a tenant's monitor sending it to /readyz) is no guess at the admin key.
    tenant = {"Authorization": f"Bearer {await stack.api_key('team-m')}"}
    for _ in range(30):
        assert "checks" not in (await http.get("/readyz", headers=tenant)).json()
    for i in range(20):
        if i % 2:
            wrong = await http.post("/console/login", data={"admin_key": f"guess-{i}"})
        else:
            wrong = await http.get("/admin/keys", headers={"Authorization": f"Bearer g-{i}"})
        assert wrong.status_code == 401, (i, wrong.text)
    refused = await http.post("/console/login", data={"admin_key": ADMIN})
    assert refused.status_code == 429
    assert "too many wrong admin keys" in refused.text
    assert int(refused.headers["retry-after"]) >= 1
    api = await http.get("/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"})
    assert api.status_code == 429
    assert int(api.headers["retry-after"]) >= 1
    ready = await http.get("/readyz", headers={"Authorization": f"Bearer {ADMIN}"})
    assert "checks" not in ready.json()  # what anyone gets
    assert "server" not in ready.headers  # and no banner naming the server
    await asyncio.sleep(1.1)
    assert (await http.post("/console/login", data={"admin_key": ADMIN})).status_code == 303


async def test_a_team_name_told_apart_only_by_invisible_characters_is_refused(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    http, csrf = await _logged_in(stack, ingress)
    for name in ("team-a\u200b", "\u202eevil", "team\u00a0a", "team\u2028a", "team-a\u3164"):
        opened = await http.post("/console/team", data={"name": name, "csrf": csrf})
        assert opened.status_code == 400, (name, opened.text)
        assert "invisible" in opened.text
    assert (
        await http.post("/console/team", data={"name": "team a", "csrf": csrf})
    ).status_code == 303


async def test_a_session_logged_out_ends_for_a_copy_of_its_cookie_on_every_replica(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    other = await stack.start_ingress(admin_key=ADMIN)
    http, csrf = await _logged_in(stack, ingress)
    cookie = http.cookies[COOKIE]
    copies = [stack.http(replica, follow_redirects=False) for replica in (ingress, other)]
    for copy in copies:
        copy.cookies.set(COOKIE, cookie, path="/console")
        assert 'id="teams"' in (await copy.get("/console")).text  # the session, copied
    out = await http.post("/console/logout", data={"csrf": csrf})
    assert out.status_code == 303
    for copy in copies:
        assert 'name="admin_key"' in (await copy.get("/console")).text  # ended everywhere


async def test_forms_need_the_sessions_token_and_the_consoles_own_origin(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    await stack.api_key("team-f", size=3)
    http, csrf = await _logged_in(stack, ingress)
    form = {"size": "9", "complexity": "1", "tier": "hi", "supersede_grace_tokens": "0"}

    no_token = await http.post("/console/teams/team-f", data=form)
    assert no_token.status_code == 403
    other_site = await http.post(
        "/console/teams/team-f",
        data={**form, "csrf": csrf},
        headers={"Origin": "https://evil.example"},
    )
    assert other_site.status_code == 403
    anonymous = await stack.http(ingress, follow_redirects=False).post(
        "/console/teams/team-f", data={**form, "csrf": csrf}
    )
    assert anonymous.status_code == 303
    assert (await get_team(stack.redis, RedisKeys(stack.prefix), "team-f")).size == 3

    bad = await http.post("/console/teams/team-f", data={**form, "size": "0", "csrf": csrf})
    assert bad.status_code == 400
    assert "size" in bad.text
    saved = await http.post("/console/teams/team-f", data={**form, "csrf": csrf})
    assert saved.status_code == 303
    assert (await get_team(stack.redis, RedisKeys(stack.prefix), "team-f")).size == 9
    page = await http.get(saved.headers["location"])
    assert "Saved." in page.text


async def test_team_links_quote_the_name_and_a_name_no_url_can_reach_is_refused(
    stack: LiveStack,
) -> None:
    """A team name is one path segment of a console link: quoted whole ('/' too, which
    Jinja's urlencode keeps); a new name with '/' or a dot segment, which no link can reach,
    is refused when it is opened, naming why."""
    ingress = await stack.start_ingress(admin_key=ADMIN)
    await stack.api_key("team #1?", size=2)
    keys = RedisKeys(stack.prefix)
    await stack.redis.sadd(keys.teams(), "old/team")  # from before names were checked
    http, csrf = await _logged_in(stack, ingress)
    overview = (await http.get("/console")).text
    assert 'href="/console/teams/team%20%231%3F"' in overview
    assert 'href="/console/teams/old%2Fteam"' in overview
    page = await http.get("/console/teams/team%20%231%3F")
    assert 'action="/console/teams/team%20%231%3F/keys"' in page.text
    # The old name's link leads to its page (the routes take a '/' as the admin API's do).
    old = await http.get("/console/teams/old%2Fteam")
    assert old.status_code == 200
    assert 'action="/console/teams/old%2Fteam/keys"' in old.text

    for name in ("org/team", ".."):
        opened = await http.post("/console/team", data={"name": name, "csrf": csrf})
        assert opened.status_code == 400, opened.text
        assert "team" in opened.text
    opened = await http.post("/console/team", data={"name": "org/team", "csrf": csrf})
    assert "'/'" in opened.text


async def test_a_key_made_on_the_console_works_and_one_revoked_there_is_refused(
    stack: LiveStack,
) -> None:
    ingress = await stack.start_ingress(admin_key=ADMIN)
    await stack.start_worker("completion")
    http, csrf = await _logged_in(stack, ingress)
    made = await http.post("/console/teams/team-k/keys", data={"csrf": csrf})
    assert made.status_code == 200
    match = re.search(r'<pre id="new-key">([^<]+)</pre>', made.text)
    assert match is not None
    key = match.group(1)
    body = {"model": "laneway-code", "prompt": "def f():", "max_tokens": 4}
    served = await stack.http(ingress, key).post("/v1/completions", json=body)
    assert served.status_code == 200, served.text

    key_id = re.search(r'data-key="(key-[0-9a-f]+)"', made.text)
    assert key_id is not None
    revoked = await http.post(f"/console/keys/{key_id.group(1)}/revoke", data={"csrf": csrf})
    assert revoked.status_code == 303
    refused = await stack.http(ingress, key).post("/v1/completions", json=body)
    assert refused.status_code == 401
    page = await http.get(revoked.headers["location"])
    assert key_id.group(1) not in page.text


async def test_the_pages_show_what_the_topics_and_redis_hold(stack: LiveStack) -> None:
    """Rollups (the latest revision of each hour), breaker levels and their changes."""
    await clear_of_the_hour_turn(60)  # the page's "this hour" is the hour the rollups are for
    now = time.time()
    hour = int(now) // 3600 * 3600
    producer = await stack.producer()

    def rollup(hour_start: int, requests: int, *, final: bool) -> bytes:
        return orjson.dumps(
            {
                "v": 1,
                "team": "team-p",
                "class": "chat",
                "model": "laneway-chat",
                "hour": time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(hour_start)),
                "hour_start": hour_start,
                "requests": requests,
                "ok": requests - 1,
                "errors": 0,
                "dropped": 1,
                "statuses": {"ok": requests - 1, "superseded": 1},
                "prompt_tokens": 100 * requests,
                "completion_tokens": 10 * requests,
                "cost": 0.01 * requests,
                "latency_ms": {"p50": 40.0, "p99": 310.0, "p999": 400.0},
                "revision": requests + final,
                "final": final,
                "ts": now,
            }
        )

    for value in (
        rollup(hour - 5 * 3600, 30, final=True),
        rollup(hour, 4, final=False),
        rollup(hour, 9, final=False),
        b"not json",
    ):
        await producer.send_and_wait(stack.topics.usage_hourly, value, key=b"team-p")
    change = {
        "v": 1,
        "kind": "breaker",
        "subject": "breaker:laneway-chat:team-p",
        "route": "laneway-chat",
        "team": "team-p",
        "level": 2,
        "previous": 1,
        "rate": 0.125,
        "requests": 80,
        "since": now,
        "ts": now,
    }
    await producer.send_and_wait(stack.topics.control, orjson.dumps(change), key=b"x")
    # Two replicas probe the chat pool: one failed, then the other passed. Each is shown.
    for replica, ok in (("r-bad", False), ("r-good", True)):
        probe = {"v": 1, "kind": "probe", "subject": "probe:chat", "pool": "chat", "ok": ok}
        probe |= {"latency_ms": 12.0, "error": None if ok else "timed out", "ingress": replica}
        await producer.send_and_wait(
            stack.topics.control, orjson.dumps({**probe, "ts": now}), key=b"probe:chat"
        )
    keys = RedisKeys(stack.prefix)
    level = {"level": 2, "rate": 0.125, "since": now, "requests": 80, "cooldown_s": 30.0}
    level |= {"route": "laneway-chat", "team": "team-p"}  # as the streams app writes it
    await stack.redis.set(keys.breaker("laneway-chat", "team-p"), orjson.dumps(level))

    ingress = await stack.start_ingress(admin_key=ADMIN)
    await stack.api_key("team-p", size=2)
    http, _ = await _logged_in(stack, ingress)
    page = (await http.get("/console")).text
    row = re.search(r'<tr data-team="team-p" data-class="chat".*?</tr>', page, re.S)
    assert row is not None, page
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(0), re.S)
    assert cells[3:6] == ["9", "990", "0.0900"]  # the latest revision of the open hour
    assert "superseded 1" in row.group(0)
    assert "provisional r9" in row.group(0)
    breaker = page[page.index('id="breakers"') :]
    assert '<tr class="level-2"><td>laneway-chat</td><td>team-p</td>' in breaker
    assert "1 → 2" in breaker
    probes = page[page.index('id="probes"') :]
    assert "<td>r-bad</td><td>timed out</td>" in probes
    assert "<td>r-good</td>" in probes

    team_page = (await http.get("/console/teams/team-p")).text
    plots = team_page[team_page.index('id="plots"') :]
    assert plots.count("<svg") == 2
    assert plots.count("<rect") == 4  # prompt and completion bars of two hours
    assert "chat p99" in plots
    assert "<polyline" in plots


async def test_the_feed_read_again_after_a_failure_holds_each_change_once(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console's reader starts again from the day before when it fails: what it read
    the first time must not be listed twice."""
    producer = await stack.producer()

    async def change(level: int) -> None:
        record = {"v": 1, "kind": "breaker", "subject": f"breaker:r{level}", "route": "r"}
        record |= {"level": level, "previous": 0, "ts": time.time()}
        await producer.send_and_wait(stack.topics.control, orjson.dumps(record), key=b"x")

    await change(1)
    feed = ConsoleFeed(CommonSettings(**stack.common))
    await feed.ready()
    try:
        assert [c.data["level"] for c in feed.changes] == [1]
        fold, failed = feed._fold, []

        def fail_once(topic: str, raw: bytes | None) -> None:
            if not failed:
                failed.append(raw)
                raise RuntimeError("a record the feed could not fold")
            fold(topic, raw)

        monkeypatch.setattr(feed, "_fold", fail_once)
        await change(2)
        await eventually(lambda: len(feed.changes) >= 2, 20, "the feed to read again")
        await asyncio.sleep(1)  # anything read twice has come in too
        assert failed
        assert [c.data["level"] for c in feed.changes] == [1, 2]
    finally:
        await feed.stop()


@pytest.mark.timeout(120)
async def test_a_hung_redis_costs_the_console_the_sections_it_feeds_not_the_page(
    services: Services, tmp_path: Path, prefix: str
) -> None:
    """An operator opens the console while Redis hangs: what Kafka feeds is shown, what Redis
    holds says it is not shown, and a form says its change may not be saved (HTML, 503)."""
    server = RedisServer(port=free_port(), data_dir=tmp_path / "redis")
    server.start()
    stack = LiveStack(Services(services.bootstrap, server.url), prefix)
    assert server.pid is not None
    try:
        await stack.create_topics()
        now = time.time()
        change = {"v": 1, "kind": "breaker", "subject": "breaker:laneway-chat:team-h"}
        change |= {"route": "laneway-chat", "team": "team-h", "level": 2, "previous": 1}
        change |= {"rate": 0.125, "requests": 80, "since": now, "ts": now}
        producer = await stack.producer()
        await producer.send_and_wait(stack.topics.control, orjson.dumps(change), key=b"x")
        ingress = await stack.start_ingress(admin_key=ADMIN)
        await stack.api_key("team-h", size=2)
        http, csrf = await _logged_in(stack, ingress)
        before = (await http.get("/console")).text
        assert 'data-team="team-h"' in before
        assert "Redis did not answer" not in before

        os.kill(server.pid, signal.SIGSTOP)
        try:
            page = await http.get("/console")
            assert page.status_code == 200, page.text[:300]
            assert "Redis did not answer" in page.text
            assert 'data-team="team-h"' not in page.text
            teams = page.text[page.text.index('id="teams"') : page.text.index('id="usage"')]
            assert "not shown: Redis did not answer" in teams
            # The breaker's change came from Kafka: shown all the same.
            assert "1 → 2" in page.text[page.text.index('id="breakers"') :]

            team = await http.get("/console/teams/team-h")
            assert team.status_code == 200, team.text[:300]
            assert 'id="team-form"' not in team.text
            assert 'id="create-key"' not in team.text
            assert 'id="team-usage"' in team.text

            edit = await http.post(
                "/console/teams/team-h",
                data={"csrf": csrf, "size": "3", "complexity": "1", "tier": "hi"}
                | {"supersede_grace_tokens": "0"},
            )
            assert edit.status_code == 503
            assert edit.headers["content-type"].startswith("text/html")
            assert "the change may not have been saved" in edit.text
        finally:
            os.kill(server.pid, signal.SIGCONT)

        async def answered_again() -> bool:
            text = (await http.get("/console")).text
            return 'data-team="team-h"' in text and "Redis did not answer" not in text

        await eventually(
            answered_again, 15, "the console showing Redis's sections again", every_s=0.5
        )
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        await stack.stop()
        server.stop()
