"""Fuzzing every HTTP route of the ingress on the real stack (Kafka, Redis, workers).

Hypothesis generates requests: OpenAI-shaped bodies with wrong types, extra fields and
extreme values, random JSON and random bytes, ``X-Laneway-*`` headers, keys (the team's, the
admin's, a revoked one, garbage), path parameters and query strings. The promise checked on
each: a response below 500, on a connection the server did not drop.

``make test`` sends ``--fuzz-examples`` (3,000) with a fixed seed; longer on demand:
``.venv/bin/pytest tests/test_fuzz_http.py --fuzz-examples 50000 --timeout 0`` (and
``--fuzz-seed N`` for other draws).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from laneway.apikeys import hash_key, key_id
from tests.stack import LiveStack

ADMIN = "fuzz-admin-key-0123"
BODY_LIMIT = 16_384  # small, so generated bodies reach past it too

# --- JSON and text ---------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# What a header value can be on the wire: visible Latin-1 and inner spaces and tabs.
header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
).map(str.strip)
counts = st.integers(-3, 5000) | st.integers() | json_values
rates = st.floats(-1, 3, allow_nan=False) | json_values
texts = st.text(max_size=200) | json_values

OPENAI_FIELDS = {
    "max_tokens": counts,
    "max_completion_tokens": counts,
    "temperature": rates,
    "top_p": rates,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans() | json_values, "extra": json_values}
    )
    | json_values,
    "stop": st.lists(st.text(max_size=4), max_size=34) | texts,
    "n": st.integers(0, 3) | json_values,
    "echo": st.booleans() | json_values,
    "logprobs": st.booleans() | counts,
    "user": texts,
    "seed": counts,
    "tools": st.just([]) | json_values,
    "metadata": json_values,
    "response_format": st.just({"type": "text"}) | json_values,
    "surprise": json_values,
}
MODELS = st.sampled_from(["laneway-code", "laneway-chat", "gpt-4o", ""]) | json_values
PROMPTS = st.text(max_size=300) | st.sampled_from(["def f():", "x = 1\n" * 400]) | json_values
# What a well-behaved client sends: these reach the workers and come back with text.
VALID_FIELDS = {
    "max_tokens": st.integers(1, 128),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.lists(st.text(max_size=4), max_size=12),
    "user": st.text(max_size=20),
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
}
SERVED = st.sampled_from(["laneway-code", "laneway-chat"])

completion_bodies = st.fixed_dictionaries(
    {"model": MODELS, "prompt": PROMPTS}, optional={"suffix": texts, **OPENAI_FIELDS}
)


def _options_of_a_stream(body: dict[str, Any]) -> bool:
    """Stream options are valid only with ``stream`` true (OpenAI's rule, vLLM's too)."""
    return bool(body.get("stream")) or not body.get("stream_options")


valid_completion_bodies = st.fixed_dictionaries(
    {"model": SERVED, "prompt": st.text(max_size=300)},
    optional={"suffix": st.text(max_size=30), **VALID_FIELDS},
).filter(_options_of_a_stream)
messages = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | texts,
        "content": st.text(max_size=200)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]) | texts, "text": texts}
            ),
            max_size=3,
        )
        | json_values,
    },
    optional={"name": texts, "tool_calls": json_values, "refusal": json_values},
)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=200)}
    ),
    min_size=1,
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"model": MODELS, "messages": st.lists(messages, max_size=4) | json_values},
    optional=OPENAI_FIELDS,
)
valid_chat_bodies = st.fixed_dictionaries(
    {"model": SERVED, "messages": valid_messages},
    optional={**VALID_FIELDS, "max_completion_tokens": st.integers(1, 512)},
).filter(_options_of_a_stream)
team_bodies = st.fixed_dictionaries(
    {},
    optional={
        "size": counts,
        "complexity": rates,
        "tier": st.sampled_from(["hi", "lo", "mid"]) | json_values,
        "supersede_grace_tokens": counts,
        "surprise": json_values,
    },
)
valid_team_bodies = st.fixed_dictionaries(
    {"size": st.integers(1, 100)},
    optional={
        "complexity": st.floats(0.01, 10),
        "tier": st.sampled_from(["hi", "lo"]),
        "supersede_grace_tokens": st.integers(0, 64),
    },
)
key_bodies = st.fixed_dictionaries({}, optional={"team": texts, "surprise": json_values})
valid_key_bodies = st.fixed_dictionaries({"team": st.text(min_size=1, max_size=50)})
canary_bodies = st.fixed_dictionaries(
    {},
    optional={
        "target": texts,
        "steps": st.lists(st.floats(allow_nan=True) | json_values, max_size=6) | json_values,
        "surprise": json_values,
    },
)
valid_canary_bodies = st.fixed_dictionaries(
    {"target": st.text(min_size=1, max_size=50)},
    optional={
        "steps": st.lists(st.floats(0.5, 99), min_size=0, max_size=3).map(
            lambda ws: [*sorted(set(ws)), 100.0]
        )
    },
)
shadow_bodies = st.fixed_dictionaries(
    {},
    optional={
        "target": texts,
        "share": st.floats(allow_nan=True) | json_values,
        "surprise": json_values,
    },
)
valid_shadow_bodies = st.fixed_dictionaries(
    {"target": st.text(min_size=1, max_size=50), "share": st.floats(0.001, 1)}
)
raw_bodies = st.binary(max_size=300) | st.sampled_from(
    [
        b"",
        b"{",
        b"null",
        b"[]",
        b'{"model": "laneway-code", "prompt": "\\ud800"}',
        b'{"model": "laneway-code", "prompt": "x", "max_tokens": 1e400}',
        b'{"model": "laneway-code", "prompt": "x", "temperature": NaN}',
        b"\xff\xfe{}",
        b"{" + b" " * (BODY_LIMIT + 10) + b"}",  # over the body limit
    ]
)


# The console's forms (urlencoded); "CSRF" stands for the session's token, filled in when sent.
_CSRF = st.sampled_from(["CSRF", "", "x" * 43]) | st.text(max_size=50)


def forms(fields: dict[str, st.SearchStrategy[str]]) -> st.SearchStrategy[bytes]:
    """Forms with the console's fields (the token mostly right) or any bytes."""
    shaped = st.fixed_dictionaries({"csrf": _CSRF}, optional=fields).map(
        lambda f: urlencode(f).encode()
    )
    return st.one_of(shaped, shaped, shaped, raw_bodies)


form_text = st.text(max_size=40) | st.sampled_from(["1", "0", "-1", "nan", "1e400", "9" * 5000])
console_team_forms = forms(
    {
        "size": form_text,
        "complexity": form_text,
        "tier": st.sampled_from(["hi", "lo"]) | form_text,
        "supersede_grace_tokens": form_text,
    }
)
console_forms = forms({"name": st.text(max_size=210), "surprise": form_text})
login_forms = st.one_of(
    st.fixed_dictionaries({}, optional={"admin_key": st.just(ADMIN) | st.text(max_size=40)}).map(
        lambda f: urlencode(f).encode()
    ),
    raw_bodies,
)


def _encoded(value: Any) -> bytes:
    return json.dumps(value).encode()  # the stdlib: integers of any size, as a client may


def bodies(
    valid: st.SearchStrategy[Any], shaped: st.SearchStrategy[Any]
) -> st.SearchStrategy[bytes]:
    """Valid bodies a third of the time (they get through to the workers), the route's shape
    with wrong values a third, and any JSON or bytes the rest."""
    return st.one_of(
        valid.map(_encoded),
        valid.map(_encoded),
        shaped.map(_encoded),
        shaped.map(_encoded),
        json_values.map(_encoded),
        raw_bodies,
    )


NO_BODY = st.just(b"") | raw_bodies


def _multipart(fields: dict[str, bytes]) -> bytes:
    """A multipart/form-data body with boundary ``x`` (the fuzzed content-type may say so)."""
    parts = b""
    for name, value in fields.items():
        filename = b'; filename="in.jsonl"' if name == "file" else b""
        parts += b'--x\r\nContent-Disposition: form-data; name="' + name.encode() + b'"'
        parts += filename + b"\r\n\r\n" + value + b"\r\n"
    return parts + b"--x--\r\n"


batch_lines = st.lists(
    valid_chat_bodies.map(
        lambda body: {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }
    ).map(_encoded)
    | st.binary(max_size=80),
    max_size=4,
).map(b"\n".join)
file_bodies = st.one_of(
    st.fixed_dictionaries({"purpose": st.just(b"batch"), "file": batch_lines}).map(_multipart),
    st.dictionaries(
        st.sampled_from(["purpose", "file", "x"]), st.binary(max_size=100), max_size=3
    ).map(_multipart),
    raw_bodies,
)
batch_bodies = st.fixed_dictionaries(
    {},
    optional={
        "input_file_id": texts,
        "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/completions"]) | texts,
        "completion_window": st.just("24h") | texts,
        "metadata": json_values,
    },
)
valid_batch_bodies = st.fixed_dictionaries(
    {
        "input_file_id": st.sampled_from(["file-0", "file-" + "0" * 24]),
        "endpoint": st.just("/v1/chat/completions"),
        "completion_window": st.just("24h"),
    }
)
# Each route of the app and the bodies it is sent; test_every_route_is_fuzzed keeps this in
# step with the app.
ROUTES: dict[tuple[str, str], st.SearchStrategy[bytes]] = {
    ("POST", "/v1/completions"): bodies(valid_completion_bodies, completion_bodies),
    ("POST", "/v1/chat/completions"): bodies(valid_chat_bodies, chat_bodies),
    ("GET", "/v1/models"): NO_BODY,
    ("GET", "/v1/models/{model_id}"): NO_BODY,
    ("DELETE", "/v1/requests/{request_id}"): NO_BODY,
    ("GET", "/healthz"): NO_BODY,
    ("GET", "/readyz"): NO_BODY,
    ("GET", "/metrics"): NO_BODY,
    ("PUT", "/admin/teams/{team}"): bodies(valid_team_bodies, team_bodies),
    ("GET", "/admin/teams/{team}"): NO_BODY,
    ("POST", "/admin/keys"): bodies(valid_key_bodies, key_bodies),
    ("GET", "/admin/keys"): NO_BODY,
    ("DELETE", "/admin/keys/{key_or_id}"): NO_BODY,
    ("POST", "/v1/files"): file_bodies,
    ("GET", "/v1/files/{file_id}"): NO_BODY,
    ("GET", "/v1/files/{file_id}/content"): NO_BODY,
    ("POST", "/v1/batches"): bodies(valid_batch_bodies, batch_bodies),
    ("GET", "/v1/batches"): NO_BODY,
    ("GET", "/v1/batches/{batch_id}"): NO_BODY,
    ("POST", "/v1/batches/{batch_id}/cancel"): NO_BODY,
    ("GET", "/admin/canary"): NO_BODY,
    ("GET", "/admin/canary/"): NO_BODY,
    ("PUT", "/admin/canary/{model}"): bodies(valid_canary_bodies, canary_bodies),
    ("POST", "/admin/canary/{model}/abort"): NO_BODY,
    ("GET", "/admin/shadow"): NO_BODY,
    ("GET", "/admin/shadow/"): NO_BODY,
    ("PUT", "/admin/shadow/{model}"): bodies(valid_shadow_bodies, shadow_bodies),
    ("POST", "/admin/shadow/{model}/stop"): NO_BODY,
    ("GET", "/console"): NO_BODY,
    ("GET", "/console/static/{name}"): NO_BODY,
    ("POST", "/console/login"): login_forms,
    ("POST", "/console/logout"): console_forms,
    ("POST", "/console/team"): console_forms,
    ("GET", "/console/teams/{team}"): NO_BODY,
    ("POST", "/console/teams/{team}"): console_team_forms,
    ("POST", "/console/teams/{team}/keys"): console_forms,
    ("POST", "/console/keys/{key_id}/revoke"): console_forms,
}
_SMALL_INT = re.compile(r"^[0-9]{1,4}$")


def _may_expire(deadline: str) -> bool:
    """A valid deadline shorter than the completion default: a 504 would be its answer (the
    documented one), not a fault; such values are left out."""
    return bool(_SMALL_INT.match(deadline)) and 0 < int(deadline) < 2000


laneway_headers = st.fixed_dictionaries(
    {},
    optional={
        "x-laneway-session": header_text | st.sampled_from(["src/app.py", "s" * 257]),
        "x-laneway-seq": st.integers(-5, 2**64).map(str) | header_text,
        "x-laneway-deadline-ms": (
            st.integers(2000, 10**12).map(str) | header_text | st.sampled_from(["0", "-1", "1e3"])
        ).filter(lambda v: not _may_expire(v)),
        "x-laneway-priority": st.sampled_from(["hi", "lo", "HI"]) | header_text,
        "content-type": st.sampled_from(
            ["application/json", "text/plain", "multipart/form-data; boundary=x"]
        )
        | header_text,
    },
)


class Caller:
    """The keys a request may carry: drawn by name, resolved once the stack is up. The
    console's session goes as a cookie, and its token into the forms."""

    def __init__(
        self, team_key: str, revoked_key: str, console_cookie: str = "", csrf: str = ""
    ) -> None:
        self.console_cookie = console_cookie
        self.csrf = csrf
        self.by_name = {
            "team": f"Bearer {team_key}",
            "admin": f"Bearer {ADMIN}",
            "revoked": f"Bearer {revoked_key}",
            "unknown": "Bearer lw-" + "u" * 32,
        }


def auth(route: tuple[str, str]) -> st.SearchStrategy[str]:
    """The key a request carries: mostly the right one for the route, else any other."""
    prefixes = {"/admin": "admin", "/console": "console"}
    right = next((who for p, who in prefixes.items() if route[1].startswith(p)), "team")
    names = [right] * 5 + ["team", "admin", "revoked", "unknown", "none", "console"]
    return st.sampled_from(names) | header_text.map(lambda t: "=" + t)


path_params = st.text(max_size=60) | st.sampled_from(["team-a", "cmpl-0", "key-0000000000000000"])
queries = st.none() | st.dictionaries(
    st.sampled_from(["team", "x", "limit", "after"]), st.text(max_size=30), max_size=2
)


def _url(template: str, param: str) -> str:
    return re.sub(r"\{[^}]+\}", quote(param, safe=""), template)


def test_every_route_is_fuzzed(stack: LiveStack) -> None:
    from ingress import create_app  # noqa: PLC0415 - the app's routes, without a lifespan
    from ingress.settings import IngressSettings  # noqa: PLC0415

    app = create_app(IngressSettings(**stack.common))
    # The routers' routes, from the OpenAPI description; the plain Starlette ones (the two
    # hot paths, the docs) from the app's own list.
    served = {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        for method in operations
    }
    # ... and the routers' routes left out of the description (the web console's), from the
    # routers themselves.
    included = [
        sub
        for route in app.routes
        for sub in getattr(getattr(route, "original_router", None), "routes", [route])
    ]
    served |= {
        # A converter ({model_id:path}: ids such as org/name) is the OpenAPI path's parameter.
        (method, re.sub(r":\w+\}", "}", str(getattr(route, "path", ""))))
        for route in included
        for method in set(getattr(route, "methods", None) or ()) - {"HEAD"}
    }
    assert served == set(ROUTES), "a route without a body strategy in ROUTES (or one gone)"


# Hypothesis draws in a thread while the stack serves on this process's event loop, whose
# clients (Kafka's node choice, Redis's retry jitter) use the global `random`: Hypothesis
# sees its state move during a draw and takes it for the strategy's doing. It is not.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
# 3,000 requests, each generated, sent and checked on two shared cores: 57 s beside a bench,
# past the suite's 120 s (a guard against hangs, not a speed bound) with more load beside.
@pytest.mark.timeout(420)
@pytest.mark.slow
async def test_no_generated_request_gets_a_5xx_or_a_dropped_connection(
    stack: LiveStack, request: pytest.FixtureRequest
) -> None:
    examples: int = request.config.getoption("--fuzz-examples")
    fuzz_seed: int | None = request.config.getoption("--fuzz-seed")
    ingress = await stack.start_ingress(admin_key=ADMIN, max_body_bytes=BODY_LIMIT)
    for pool in ("completion", "chat", "batch"):  # every pool served: /readyz says ready
        await stack.start_worker(pool)
    revoked = await stack.api_key("fuzz-team")
    admin = stack.http(ingress, ADMIN)
    assert (await admin.delete(f"/admin/keys/{key_id(hash_key(revoked))}")).status_code == 200
    console = stack.http(ingress, follow_redirects=False)
    assert (await console.post("/console/login", data={"admin_key": ADMIN})).status_code == 303
    session = console.cookies["laneway_console"]
    page = (await console.get("/console")).text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf is not None
    caller = Caller(
        await stack.api_key("fuzz-team", size=1000),
        revoked,
        console_cookie=f"laneway_console={session}",
        csrf=csrf.group(1),
    )
    statuses: Counter[int] = Counter()
    hits: Counter[tuple[str, str]] = Counter()
    served: Counter[tuple[str, str]] = Counter()  # 2xx by route
    client = httpx.Client(base_url=ingress.base_url, timeout=60)

    def fuzz_route(route: tuple[str, str], count: int) -> None:
        method, template = route

        @settings(
            max_examples=count,
            deadline=None,
            database=None,
            derandomize=fuzz_seed is None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
        )
        @given(
            body=ROUTES[route],
            extra=laneway_headers,
            who=auth(route),
            param=path_params,
            params=queries,
        )
        def one_request(
            body: bytes,
            extra: dict[str, str],
            who: str,
            param: str,
            params: dict[str, str] | None,
        ) -> None:
            headers = {k: v.encode("latin-1") for k, v in extra.items()}
            if who.startswith("="):
                headers["authorization"] = who[1:].encode("latin-1")
            elif who == "console":
                headers["cookie"] = caller.console_cookie.encode()
                body = body.replace(b"csrf=CSRF", b"csrf=" + caller.csrf.encode())
            elif who != "none":
                headers["authorization"] = caller.by_name[who].encode()
            url = _url(template, param)
            try:
                response = client.request(method, url, headers=headers, content=body, params=params)
            except httpx.TransportError as exc:
                raise AssertionError(f"connection dropped: {method} {url}: {exc!r}") from exc
            statuses[response.status_code] += 1
            hits[route] += 1
            served[route] += response.is_success
            if template == "/readyz" and response.status_code == 503:
                # Its contract: 503 says "not ready" to a load balancer; and only that.
                assert response.json() == {"ready": False}
                return
            assert response.status_code < 500, (
                f"{method} {url} {headers} {body[:300]!r} → {response.status_code} "
                f"{response.text[:500]}"
            )

        (one_request if fuzz_seed is None else seed(fuzz_seed)(one_request))()

    def fuzz_all() -> None:
        # The interactive paths get half the requests: they are where bodies matter most.
        interactive = ("/v1/completions", "/v1/chat/completions")
        share = {r: 4 if r[1] in interactive else 1 for r in ROUTES}
        unit = examples / sum(share.values())
        for route in sorted(ROUTES):
            fuzz_route(route, max(1, round(unit * share[route])))

    started = time.monotonic()
    try:
        await asyncio.to_thread(fuzz_all)
    finally:
        await asyncio.to_thread(client.close)
    took = time.monotonic() - started
    print(  # the suite's own summary (pytest -s, or -rP shows it)
        f"fuzzed {sum(statuses.values())} requests in {took:.1f}s: {dict(sorted(statuses.items()))}"
        f"; served (2xx) by route: {dict(served)}"
    )
    assert sum(statuses.values()) >= examples * 0.95  # the shares, rounded
    assert set(hits) == set(ROUTES), "a route was never fuzzed"
    # Not only refusals: generated requests got through the door to the workers too.
    assert served[("POST", "/v1/completions")] > 0
    assert served[("POST", "/v1/chat/completions")] > 0
