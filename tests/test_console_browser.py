"""The console in a real browser (headless Chromium driven by Selenium) on a live stack: the
ingress and a worker in-process, the streams app as a process, Kafka and Redis real.

Log in, watch a team's usage move after traffic (the page refreshes its live sections by
itself), change the team's size, revoke its key and see the key refused.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from io import BytesIO
from pathlib import Path
from typing import Any, TypeVar

import pytest
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from laneway.apikeys import hash_key, key_id, list_keys
from laneway.constants import RedisKeys
from quota.teams import get_team
from tests.stack import LiveStack, clear_of_the_hour_turn
from tests.test_streams_process import StreamsProcess

ADMIN = "console-browser-admin-key-42"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    # The suite's 120 s hang guard plus the up to 151 s the test may wait for the next hour.
    pytest.mark.timeout(120 + 151),
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (scripts/setup.sh --tests installs "
        "them: apt-get install -y chromium chromium-driver)",
    ),
]

T = TypeVar("T")


@pytest.fixture
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in CI
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1400",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


async def _in_browser(call: Callable[[], T]) -> T:
    """Selenium blocks: run it beside the event loop the stack serves on."""
    return await asyncio.to_thread(call)


def _wait(driver: Any, condition: Callable[[Any], Any], within_s: float, what: str) -> Any:
    try:
        return WebDriverWait(driver, within_s, poll_frequency=0.25).until(condition)
    except TimeoutException:
        page = driver.page_source[:3000]
        raise AssertionError(
            f"timed out after {within_s}s waiting for {what}; page:\n{page}"
        ) from None


def _cell(driver: Any, css: str) -> str | None:
    """The element's text, or None while it is not there (the page redraws it: the wait
    that calls this reads it again)."""
    try:
        return str(driver.find_element("css selector", css).text)
    except (NoSuchElementException, StaleElementReferenceException):
        return None
    except WebDriverException as exc:
        # chromedriver's own word for an element replaced between finding and reading it.
        if "does not belong to the document" in str(exc):
            return None
        raise


async def test_an_operator_logs_in_watches_usage_changes_a_team_and_revokes_a_key(
    stack: LiveStack, tmp_path: Path, browser: Any, request: pytest.FixtureRequest
) -> None:
    streams = StreamsProcess(stack, tmp_path / "streams", rollup_provisional_s=1)
    await streams.start()
    try:
        ingress = await stack.start_ingress(admin_key=ADMIN, probe_interval_s=2)
        for pool in ("completion", "chat", "batch"):
            await stack.start_worker(pool)
        key = await stack.api_key("team-web", size=4, complexity=1.0)
        api = stack.http(ingress, key)
        body = {"model": "laneway-code", "prompt": "def web():", "max_tokens": 8}
        # The page counts this hour's requests: all five must fall in one (two 60 s waits).
        await clear_of_the_hour_turn(150)
        assert (await api.post("/v1/completions", json=body)).status_code == 200
        base = ingress.base_url

        # Log in.
        def log_in() -> str:
            browser.get(f"{base}/console")
            browser.find_element("id", "admin_key").send_keys(ADMIN)
            browser.find_element("id", "login").click()
            _wait(browser, lambda d: _cell(d, "#teams"), 20, "the overview")
            return str(browser.find_element("css selector", "#teams").text)

        assert "team-web" in await _in_browser(log_in)
        cookies = await _in_browser(browser.get_cookies)
        (session,) = [c for c in cookies if c["name"] == "laneway_console"]
        assert session["httpOnly"] is True
        assert session["sameSite"] == "Strict"

        # The first request's hour shows up from the provisional rollups ...
        requests_cell = '#usage tr[data-team="team-web"][data-class="completion"] .requests'
        await _in_browser(
            lambda: _wait(
                browser, lambda d: _cell(d, requests_cell) == "1", 60, "the first request"
            )
        )
        # ... and moves after more traffic, without a reload (the live sections refresh).
        for _ in range(4):
            assert (await api.post("/v1/completions", json=body)).status_code == 200
        await _in_browser(
            lambda: _wait(browser, lambda d: _cell(d, requests_cell) == "5", 60, "5 requests")
        )
        screenshot = request.config.getoption("--console-screenshot")
        if screenshot:  # once the probes of all three pools are in
            probes = "#probes tr.ok"
            await _in_browser(
                lambda: _wait(
                    browser,
                    lambda d: len(d.find_elements("css selector", probes)) == 3,
                    60,
                    "probes",
                )
            )
            await _in_browser(lambda: _save_screenshot(browser, Path(screenshot)))

        # Change the team's size on its page.
        def resize() -> str:
            browser.find_element("link text", "team-web").click()
            size = _wait(browser, lambda d: d.find_element("id", "size"), 20, "the team page")
            size.clear()
            size.send_keys("7")
            browser.find_element("id", "save-team").click()
            _wait(browser, lambda d: _cell(d, "#message") == "Saved.", 20, "Saved.")
            return str(
                browser.find_element(
                    "css selector", '#budget tr[data-pool="interactive"] .budget'
                ).text
            )

        assert await _in_browser(resize) == str(7 * 50 * 1000)
        assert (await get_team(stack.redis, RedisKeys(stack.prefix), "team-web")).size == 7
        # The team's plots have this hour's tokens.
        svg = await _in_browser(lambda: _cell(browser, "#plots svg title"))
        assert svg == "team-web: tokens per hour, last 24 h"

        # Revoke its key: the page says so and the ingress refuses the key.
        def revoke() -> None:
            browser.find_element("css selector", "#keys button.revoke").click()
            _wait(browser, lambda d: "Key revoked" in (_cell(d, "#message") or ""), 20, "revoked")

        await _in_browser(revoke)
        refused = await api.post("/v1/completions", json=body)
        assert refused.status_code == 401, refused.text

        # A new key is shown once; the page's address is the team's, so a reload reads the
        # team page (it used to post the form again: a second key) and the live sections
        # keep refreshing (their refresh read the form's address: a 405).
        def new_key() -> tuple[str, str]:
            browser.find_element("id", "create-key").click()
            shown = _wait(browser, lambda d: _cell(d, "#new-key"), 20, "the new key")
            browser.refresh()
            _wait(browser, lambda d: d.find_elements("id", "size"), 20, "the team page")
            return str(shown), str(browser.current_url)

        shown, address = await _in_browser(new_key)
        assert address == f"{base}/console/teams/team-web"
        live = await list_keys(stack.redis, RedisKeys(stack.prefix), "team-web")
        assert [k.id for k in live] == [key_id(hash_key(shown))]

        # A session that ended under an open page: the page says its numbers stopped.
        def session_ends() -> str:
            browser.delete_all_cookies()
            note = _wait(browser, lambda d: _cell(d, "#stale"), 20, "the stale notice")
            return str(note)

        assert "the session ended" in await _in_browser(session_ends)

        # Logging out ends the page's access.
        def log_out() -> None:
            browser.get(f"{base}/console")
            browser.find_element("id", "admin_key").send_keys(ADMIN)
            browser.find_element("id", "login").click()
            _wait(browser, lambda d: _cell(d, "#teams"), 20, "the overview")
            browser.find_element("id", "logout").click()
            _wait(browser, lambda d: d.find_elements("id", "admin_key"), 20, "the login form")

        await _in_browser(log_out)
    finally:
        code = await streams.stop()
    assert code == 0, streams.log()


def _save_screenshot(driver: Any, path: Path) -> None:
    """The overview as a small PNG for the README (a 64-colour palette)."""
    image = Image.open(BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=64).save(path, optimize=True)
