"""Settings of the HTTP ingress (``python -m ingress``)."""

from __future__ import annotations

import secrets

from pydantic import (
    Field,
    SecretStr,
    field_validator,
)

from laneway.apikeys import KEY_PREFIX
from laneway.settings import CommonSettings

__all__ = ["MIN_ADMIN_KEY_CHARS", "IngressSettings"]

_BREAKER_LEVELS = ("quantized", "fallback")  # the routes of breaker levels 1 and 2
# The admin key guards the admin API, the console and /readyz's checks, which anyone who
# reaches a replica may try keys against (at any rate): too short, it could be guessed.
MIN_ADMIN_KEY_CHARS = 16


class IngressSettings(CommonSettings):
    """The OpenAI-compatible HTTP ingress."""

    host: str = Field("127.0.0.1", description="ingress listen address")
    port: int = Field(8000, ge=0, le=65535, description="ingress listen port")
    instance_id: str = Field(
        default_factory=lambda: f"ingress-{secrets.token_hex(4)}",
        pattern=r"^\S{1,200}$",
        description="names this replica's reply stream; unique per replica",
    )
    admin_key: SecretStr = Field(
        SecretStr(""),
        description="bearer key of the admin API (/admin/...), the console and /readyz's "
        f"checks; empty: disabled, else at least {MIN_ADMIN_KEY_CHARS} characters",
    )
    console_session_s: float = Field(
        8 * 3600.0,
        ge=1,  # a cookie's max-age is whole seconds
        le=7 * 86400,
        description="web console (/console, on with the admin key): a login lasts this long",
    )
    completion_deadline_ms: int = Field(2000, gt=0, description="default completion deadline")
    chat_deadline_ms: int = Field(30_000, gt=0, description="default chat deadline")
    reply_timeout_s: float = Field(300.0, gt=0, description="longest wait for a reply")
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="how long a client may take to send a request's headers (from its "
        "connection, or the request's first byte) and a completion's or chat's body: past "
        "it the connection is closed, or the body answered 408",
    )
    shutdown_grace_s: int = Field(
        10,
        ge=0,
        le=3600,
        description="on SIGTERM, how long open requests may still finish; each one still open "
        "then is answered 503 (send it again), its budget given back or its worker told to "
        "stop it (a client's retry elsewhere does not run beside it); keep the platform's "
        "stop period a few seconds longer",
    )
    max_body_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        description="largest request body accepted; a longer one gets 413 before it is read "
        "to its end (a 32k-token chat is about 130 kB of JSON)",
    )
    max_file_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1024,
        description="largest file POST /v1/files accepts (a batch input file; its bytes go to "
        "Kafka, never to Redis)",
    )
    batch_max_lines: int = Field(
        50_000, gt=0, description="most lines (requests) a batch input file may have"
    )
    batch_max_batches: int = Field(
        2000,
        gt=0,
        description="batches one team may have within their 7-day life (429 beyond): each "
        "keeps a record in Redis that long",
    )
    team_stored_bytes: int = Field(
        10 * 1024**3,
        ge=1024 * 1024,
        description="bytes one team may store on Kafka through the Files and Batches API "
        "within their 7-day life (429 beyond): each upload counts its size, each batch its "
        "input file's again (its lines are written once more), each at least 1 MiB",
    )
    cancels_per_s: int = Field(
        50,
        gt=0,
        description="DELETE /v1/requests/{id} calls one team may make per second, over all "
        "replicas (429 beyond): each tombstone reaches every worker",
    )
    cancel_hold_ms: int = Field(
        25,
        ge=0,
        le=1000,
        description="a gone client's tombstone (with a session and seq) waits this long before "
        "its Kafka record is written; none is if this ingress stores a newer seq of the session "
        "on the same topic meanwhile (Redis gets it at once either way; 0: no wait)",
    )
    breaker_routes: dict[str, dict[str, str]] = Field(
        default_factory=lambda: {
            "laneway-code": {"quantized": "laneway-code-fp8", "fallback": "laneway-code-small"},
            "laneway-chat": {"quantized": "laneway-chat-int8", "fallback": "laneway-chat-small"},
        },
        description="breaker: model → {quantized, fallback} routes of levels 1 and 2 (JSON)",
    )
    probe_interval_s: float = Field(
        300.0, ge=0, description="health probe of every pool this often (0: off)"
    )
    probe_timeout_s: float = Field(10.0, gt=0, description="a probe slower than this fails")
    affinity_prefix_chars: int = Field(
        256, gt=0, description="prompt prefix hashed into the affinity key without a session"
    )
    quota_lease_share: float = Field(
        0.01,
        ge=0,
        le=0.1,
        description="share of a team's hourly interactive budget this replica takes from "
        "Redis at once and admits from locally (0: one Redis reservation per request)",
    )
    shadow_max_in_flight: int = Field(
        64,
        gt=0,
        description="shadow routes: copies of requests this replica may have on their way to "
        "Kafka at once; more are skipped (a mirror never queues behind, or ahead of, a client)",
    )
    quota_lease_idle_s: float = Field(
        10.0, gt=0, description="an unused quota lease goes back to its pool after this long"
    )

    @field_validator("admin_key")
    @classmethod
    def _admin_key_long_enough(cls, key: SecretStr) -> SecretStr:
        length = len(key.get_secret_value())
        if 0 < length < MIN_ADMIN_KEY_CHARS:
            raise ValueError(
                f"{length} characters, under the {MIN_ADMIN_KEY_CHARS} an admin key must have "
                "(it is tried against the admin API, the console and /readyz by whoever "
                "reaches a replica); make one with `openssl rand -hex 24`, or leave it empty "
                "to turn the admin API off"
            )
        if key.get_secret_value().startswith(KEY_PREFIX):
            raise ValueError(
                f"starts with {KEY_PREFIX!r}, as a team's API key does (such a key is never "
                "taken for the admin key); make one with `openssl rand -hex 24`"
            )
        return key

    @field_validator("breaker_routes")
    @classmethod
    def _known_levels(cls, routes: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        # A misspelt level ("quantised") would leave that level on the model itself, unsaid.
        for model, alternatives in routes.items():
            unknown = sorted(set(alternatives) - set(_BREAKER_LEVELS))
            if unknown:
                raise ValueError(
                    f"{model}: {', '.join(unknown)} is not a breaker level's route "
                    f"(each model has {' and '.join(_BREAKER_LEVELS)})"
                )
            empty = [level for level, route in alternatives.items() if not route.strip()]
            if empty:
                raise ValueError(f"{model}: the {empty[0]} route is empty")
        return routes
