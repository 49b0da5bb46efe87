"""The console's pages: ``/console`` (log in, then the overview) and ``/console/teams/T``
(edit the team, its keys, its last day). Server-rendered HTML; forms post back here, carry
the session's token and are checked against the page's own origin.

A Redis that does not answer costs the sections it feeds (teams, budgets, breaker levels,
workers, keys), each saying so, not the page: what Kafka feeds (usage, breaker changes,
probes) is what an operator looks at in such a moment. A form whose change Redis did not
take is answered with a page that says so (503), not the API's JSON."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import APIRouter, FastAPI, Request
from jinja2 import Environment, PackageLoader, select_autoescape
from redis.exceptions import RedisError
from starlette.responses import RedirectResponse, Response

from ingress.admin import (
    TeamBody,
    create_team_key,
    revoke_team_key,
    save_team,
    team_budget,
    team_keys,
)
from ingress.console import overview
from ingress.console.feed import ConsoleFeed
from ingress.console.session import COOKIE, ConsoleSession, ConsoleSessions
from ingress.settings import IngressSettings
from ingress.state import IngressState
from laneway.apikeys import check_team_name
from laneway.errors import AdminKeyGuesses, BadRequest, NotFound
from laneway.logs import described
from laneway.openai_api import validate_body
from laneway.redis_circuit import RedisUnavailable, circuit_of
from quota import Team, get_team

__all__ = ["Console", "ConsoleRefusal", "console_router", "install_console"]

log = logging.getLogger(__name__)
T = TypeVar("T")

console_router = APIRouter(prefix="/console", include_in_schema=False)

HOUR_S = 3600
# A section's read of Redis waits no longer (a socket's timeout is 5 s): a hung Redis costs a
# page this, once; its sections are read side by side.
_READ_S = 2.0
_MAX_FORM_FIELDS = 20
_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends "Origin: null" with the forms, which would
    # then be refused as cross-site.
    "Referrer-Policy": "same-origin",
}


def _segment(value: object) -> str:
    """One path segment of a link: all quoted, '/' too (Jinja's ``urlencode`` keeps it)."""
    return quote(str(value), safe="")


def _clock(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(ts)))


class Console:
    """What the console keeps for the ingress's lifetime: sessions, templates, the feed."""

    def __init__(self, settings: IngressSettings) -> None:
        self.sessions = ConsoleSessions(
            settings.admin_key.get_secret_value(), settings.console_session_s
        )
        self.feed = ConsoleFeed(settings)
        # Sessions logged out on this replica (nonce: when its cookie expires), known here
        # while Redis, which every replica asks, does not answer.
        self.ended: dict[str, int] = {}
        self.templates = Environment(
            loader=PackageLoader("ingress.console", "templates"),
            autoescape=select_autoescape(default=True),
            enable_async=False,
        )
        self.templates.filters["clock"] = _clock
        self.templates.filters["segment"] = _segment

    async def stop(self) -> None:
        await self.feed.stop()

    def page(self, name: str, status_code: int = 200, **context: Any) -> Response:
        # Whether the feed has read what the topics held: until then an empty table says
        # "not read yet" (Kafka away), not "nothing happened".
        context.setdefault("feed_read", self.feed.caught_up.is_set())
        html = self.templates.get_template(name).render(**context)
        return Response(html, status_code=status_code, media_type="text/html", headers=_HEADERS)


def _console(request: Request) -> tuple[IngressState, Console]:
    state: IngressState = request.app.state.laneway
    console: Console | None = getattr(request.app.state, "console", None)
    if console is None or not state.settings.admin_key.get_secret_value():
        raise NotFound("the console is disabled (set LANEWAY_ADMIN_KEY)")
    return state, console


async def _session(request: Request, console: Console) -> ConsoleSession | None:
    """The session of the request's cookie: well signed, not expired, not logged out (on
    any replica: Redis keeps what logged out until its cookie expires; while Redis does
    not answer, only this replica's own logouts are known)."""
    session = console.sessions.verify(request.cookies.get(COOKIE))
    if session is None or session.nonce in console.ended:
        return None
    state: IngressState = request.app.state.laneway
    ended = await _RedisReads(state)(_logged_out(state, session.nonce))
    return None if ended else session


async def _logged_out(state: IngressState, nonce: str) -> bool:
    return bool(await state.redis.exists(state.keys.console_ended(nonce)))


def _to_login() -> Response:
    return RedirectResponse("/console", status_code=303, headers=_HEADERS)


async def _form(request: Request) -> dict[str, str]:
    """A urlencoded form's fields (the first value of each); ``BadRequest`` if it is not one."""
    try:
        text = (await request.body()).decode()
        fields = parse_qs(text, keep_blank_values=True, max_num_fields=_MAX_FORM_FIELDS)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"not a form: {exc}") from None
    return {name: values[0] for name, values in fields.items()}


def _same_origin(request: Request) -> bool:
    """A browser names the page a form came from; it must be this console's."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host")


@dataclass(frozen=True, slots=True)
class _Posted:
    state: IngressState
    console: Console
    session: ConsoleSession
    form: dict[str, str]


class ConsoleRefusal(Exception):
    """A console request turned away with a page or a redirect (not an API error)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def _posted(request: Request) -> _Posted:
    """A form posted by a logged-in page of this console; ``ConsoleRefusal`` otherwise."""
    state, console = _console(request)
    session = await _session(request, console)
    if session is None:
        raise ConsoleRefusal(_to_login())
    form = await _form(request)
    if not _same_origin(request) or not console.sessions.csrf_ok(session, form.get("csrf", "")):
        raise ConsoleRefusal(
            console.page(
                "login.html", 403, error="this form is stale or came from another site; reload"
            )
        )
    return _Posted(state, console, session, form)


def _hour_now() -> int:
    return int(time.time()) // HOUR_S * HOUR_S


class _RedisReads:
    """A page's reads of Redis, each on its own and within ``_READ_S``: one that fails is
    None (its section says why), and ``failure`` names the first failure for the page's
    notice. While the process's Redis circuit is open (its request path found Redis silent)
    none is tried: the page comes at once."""

    def __init__(self, state: IngressState) -> None:
        self.circuit = circuit_of(state.redis)
        self.failure: str | None = None

    async def __call__(self, read: Coroutine[Any, Any, T]) -> T | None:
        try:
            if self.circuit.open:
                read.close()
                raise RedisUnavailable("Redis is not answering (circuit open)")
            async with asyncio.timeout(_READ_S):
                return await read
        except TimeoutError:
            why = f"no answer within {_READ_S:.0f} s"
        except (RedisError, OSError) as exc:
            why = described(exc)
        log.warning("console: a Redis read failed: %s", why)
        self.failure = self.failure or why
        return None


def _html_if_redis_fails(
    handler: Callable[..., Awaitable[Response]],
) -> Callable[..., Awaitable[Response]]:
    """A form's handler whose Redis failure is answered with a console page (503) that says
    the change may not be saved, instead of the API's JSON 503."""

    @functools.wraps(handler)
    async def answered(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except (RedisError, OSError) as exc:
            log.warning("console: a form's Redis call failed: %s", described(exc))
            request: Request = kwargs["request"]
            _, console = _console(request)
            # Signed and unexpired is enough for the page's token: Redis just failed.
            session = console.sessions.verify(request.cookies.get(COOKIE))
            response = console.page(
                "unavailable.html",
                503,
                csrf=console.sessions.csrf_token(session) if session else None,
                error=(
                    f"Redis did not answer ({described(exc)}): the change may not have been saved. "
                    "Reload the page once Redis answers, and check."
                ),
            )
            response.headers["Retry-After"] = "5"
            return response

    return answered


@console_router.get("/static/{name}")
async def static(name: str) -> Response:
    media_type = _STATIC.get(name)
    if media_type is None:
        raise NotFound(f"no console file {name!r}")
    body = resources.files("ingress.console").joinpath("static", name).read_bytes()
    return Response(body, media_type=media_type, headers={"Cache-Control": "max-age=300"})


@console_router.get("")
async def console_home(request: Request) -> Response:
    state, console = _console(request)
    session = await _session(request, console)
    if session is None:
        return console.page("login.html")
    await console.feed.ready()
    hour = _hour_now()
    redis = _RedisReads(state)
    teams, breakers, pools = await asyncio.gather(
        redis(overview.teams(state)),
        redis(overview.breaker_levels(state)),
        redis(overview.pools(state)),
    )
    return console.page(
        "overview.html",
        csrf=console.sessions.csrf_token(session),
        teams=teams,
        usage=overview.usage_rows(console.feed, hour),
        hour_label=_clock(hour)[:-3],
        breakers=breakers,
        changes=overview.recent_changes(console.feed),
        pools=pools,
        probes=overview.probes(state, console.feed),
        redis_down=redis.failure,
    )


@console_router.post("/login")
async def login(request: Request) -> Response:
    _, console = _console(request)
    form = await _form(request)
    if not _same_origin(request):
        return console.page("login.html", 403, error="this form came from another site")
    state = request.app.state.laneway
    try:
        matches = state.admin_guesses.matches(
            form.get("admin_key", ""), state.settings.admin_key.get_secret_value()
        )
    except AdminKeyGuesses as exc:
        refused = console.page("login.html", 429, error=str(exc))
        refused.headers.update(exc.headers())
        return refused
    if not matches:
        return console.page("login.html", 401, error="wrong admin key")
    response = RedirectResponse("/console", status_code=303, headers=_HEADERS)
    response.set_cookie(
        COOKIE,
        console.sessions.issue(),
        max_age=int(console.sessions.ttl_s),
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https",
    )
    return response


@console_router.post("/logout")
async def logout(request: Request) -> Response:
    posted = await _posted(request)
    # Ended for good, not only in this browser: a copy of the cookie stops working too.
    nonce, expires = posted.session.nonce, posted.session.expires
    ended = posted.console.ended
    for gone in [n for n, until in ended.items() if until <= time.time()]:
        del ended[gone]
    ended[nonce] = expires
    with contextlib.suppress(RedisError, OSError, TimeoutError):
        async with asyncio.timeout(_READ_S):
            await posted.state.redis.set(
                posted.state.keys.console_ended(nonce), 1, exat=max(expires, int(time.time()) + 1)
            )
    response = _to_login()
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
    return response


@console_router.post("/team")
@_html_if_redis_fails
async def open_team(request: Request) -> Response:
    posted = await _posted(request)
    name = posted.form.get("name", "").strip()
    if not name or len(name) > 200:
        raise BadRequest("a team name has 1 to 200 characters", param="name")
    # A name no new team may have ('/' or a dot segment: no link reaches it) is refused here,
    # saying why, rather than sent on to a page that is not found.
    await check_team_name(posted.state.redis, posted.state.keys, name)
    return RedirectResponse(f"/console/teams/{quote(name, safe='')}", status_code=303)


async def _budget(state: IngressState, team: str) -> tuple[dict[str, Any], bool]:
    """The team's record and budget, and whether it is a team yet (a new one: what its
    budget would be)."""
    try:
        return await team_budget(state, team), True
    except NotFound:
        return await state.quota.enforcer.snapshot(Team(team)), False


async def _team_page(
    state: IngressState,
    console: Console,
    session: ConsoleSession,
    team: str,
    *,
    status_code: int = 200,
    **extra: Any,
) -> Response:
    await console.feed.ready()
    redis = _RedisReads(state)
    budget, keys = await asyncio.gather(redis(_budget(state, team)), redis(team_keys(state, team)))
    hour = _hour_now()
    return console.page(
        "team.html",
        status_code,
        csrf=console.sessions.csrf_token(session),
        team_name=team,
        team=budget[0] if budget else None,
        known=budget[1] if budget else True,
        keys=keys,
        redis_down=redis.failure,
        usage=overview.usage_rows(console.feed, hour, team),
        hour_label=_clock(hour)[:-3],
        charts=overview.team_charts(console.feed, team, hour),
        **extra,
    )


@console_router.get("/teams/{team:path}")
async def team_page(team: str, request: Request) -> Response:
    state, console = _console(request)
    session = await _session(request, console)
    if session is None:
        return _to_login()
    notes = {"saved": "Saved.", "revoked": "Key revoked: every replica refuses it."}
    message = next((text for flag, text in notes.items() if flag in request.query_params), None)
    return await _team_page(state, console, session, team, message=message)


# ``{team:path}``, as the admin API's: a team named with '/' before that was refused is still
# reached. The keys route comes first, or the edit route would take ``<team>/keys`` as a name.
@console_router.post("/teams/{team:path}/keys")
@_html_if_redis_fails
async def new_key(team: str, request: Request) -> Response:
    posted = await _posted(request)
    created = await create_team_key(posted.state, team)
    # Shown in this answer only; the browser's address becomes the team page's, so a reload
    # reads that page (not a second key) and the live refresh has a page to read.
    return await _team_page(
        posted.state,
        posted.console,
        posted.session,
        team,
        new_key=created,
        address=f"/console/teams/{quote(team, safe='')}",
    )


@console_router.post("/teams/{team:path}")
@_html_if_redis_fails
async def edit_team(team: str, request: Request) -> Response:
    posted = await _posted(request)
    state, console, session, form = posted.state, posted.console, posted.session, posted.form
    current = await get_team(state.redis, state.keys, team)
    fields = {
        name: form.get(name, "")
        for name in ("size", "complexity", "tier", "supersede_grace_tokens")
    }
    try:
        body = validate_body(TeamBody, {**fields, "type_through": current.type_through})
        await save_team(state, team, body)
    except BadRequest as exc:
        return await _team_page(state, console, session, team, status_code=400, error=exc.message)
    return RedirectResponse(f"/console/teams/{quote(team, safe='')}?saved", status_code=303)


@console_router.post("/keys/{key_id}/revoke")
@_html_if_redis_fails
async def revoke(key_id: str, request: Request) -> Response:
    revoked = await revoke_team_key((await _posted(request)).state, key_id)
    return RedirectResponse(
        f"/console/teams/{quote(str(revoked['team']), safe='')}?revoked", status_code=303
    )


def install_console(app: FastAPI) -> None:
    """Serve the console's routes on ``app`` (they answer 404 while the admin key is unset)."""

    async def on_refusal(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ConsoleRefusal)
        return exc.response

    app.add_exception_handler(ConsoleRefusal, on_refusal)
    app.include_router(console_router)
