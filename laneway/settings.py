"""Typed settings read from ``LANEWAY_*`` environment variables: the common ones here, each
service's in its own package (ingress/settings.py, workers/settings.py, streams/settings.py,
ops/settings.py).

A ``LANEWAY_*`` variable that no settings class knows fails start-up: a misspelt setting must
never be silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError
from redis.connection import parse_url

from laneway.constants import DECOMPRESSED_BATCH_BYTES, RedisKeys, Topics
from laneway.errors import ConfigError
from laneway.redis_circuit import (
    DEFAULT_FAILURES,
    DEFAULT_HOT_TIMEOUT_MS,
    DEFAULT_PROBE_INTERVAL_MS,
)

__all__ = [
    "SETTINGS_GROUP",
    "CommonSettings",
    "Price",
    "check_environment",
    "known_variables",
    "load_settings",
    "settings_classes",
    "settings_only",
]

# Read outside the settings classes (before a venv or Python exists, or by the test setup).
_OTHER_KNOWN_VARIABLES = {
    "LANEWAY_API_KEY",  # the CLI's batch commands
    "LANEWAY_CACHE_DIR",
    "LANEWAY_TEST_KAFKA_PORT",
    "LANEWAY_TEST_REDIS_PORT",
}


class Price(BaseModel):
    """Price of one model route, per 1,000 tokens of each kind."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    prompt: float = Field(0.0, ge=0)
    cached: float = Field(0.0, ge=0)
    completion: float = Field(0.0, ge=0)


def _default_prices() -> dict[str, Price]:
    return {
        "laneway-code": Price(prompt=0.0005, cached=0.0001, completion=0.0015),
        "laneway-chat": Price(prompt=0.001, cached=0.0002, completion=0.003),
        "*": Price(prompt=0.001, cached=0.0002, completion=0.003),
    }


class CommonSettings(BaseSettings):
    """Where Kafka and Redis are and how laneway names things in them."""

    # No setting means "for ever" or "unbounded" by inf, and a NaN compares false with every
    # bound: both are refused at the door instead of failing far from it (int(inf) on a
    # request path, a timer that never fires).
    model_config = SettingsConfigDict(env_prefix="LANEWAY_", extra="forbid", allow_inf_nan=False)

    kafka_bootstrap: str = Field(
        "127.0.0.1:19092",
        description="Kafka bootstrap servers; unset, the local stack's: "
        "127.0.0.1:LANEWAY_KAFKA_PORT",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:16379/0",
        description="Redis URL; with Redis ACL users redis://<user>:<password>@host:port/0; "
        "behind Sentinels redis+sentinel://[user:password@]host:port[,...]/<service>[/<db>] "
        "(never logged); unset, the local stack's: redis://127.0.0.1:LANEWAY_REDIS_PORT/0",
    )
    topic_prefix: str = Field(
        "laneway",
        # What Kafka takes in a topic name, short enough for the longest name built on it.
        pattern=r"^[A-Za-z0-9._-]{1,150}$",
        description="prefix of every Kafka topic (letters, digits, '.', '_', '-')",
    )
    redis_prefix: str = Field(
        "laneway", pattern=r"^\S{1,150}$", description="prefix of every Redis key (no spaces)"
    )
    redis_hot_timeout_ms: int = Field(
        DEFAULT_HOT_TIMEOUT_MS,
        ge=1,
        le=10_000,
        description="a Redis call on the request path (keys, breaker levels, quota, replies, "
        "settlement, cancels) gives up after Redis was silent this long, and its fallback "
        "answers",
    )
    redis_circuit_failures: int = Field(
        DEFAULT_FAILURES,
        ge=1,
        le=1000,
        description="after this many Redis calls in a row failed (refused; one given up "
        "because Redis answered nothing for LANEWAY_REDIS_HOT_TIMEOUT_MS is enough), a "
        "process stops calling Redis on the request path and uses its fallbacks until a "
        "probe gets an answer",
    )
    redis_probe_interval_ms: int = Field(
        DEFAULT_PROBE_INTERVAL_MS,
        ge=10,
        le=60_000,
        description="while a process does not call Redis, it sends a PING this often; the "
        "first answer within LANEWAY_REDIS_HOT_TIMEOUT_MS switches it back",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text (fields as key=value) or one JSON object a line"
    )
    watchdog_file: str = Field(
        "",
        description="ingress, workers and streams: touch this file every second from the "
        "event loop, a sign of life for a supervisor that kills a hung process (`laneway up` "
        "sets it for each process; '': off)",
    )

    max_decompressed_batch_bytes: int = Field(
        DECOMPRESSED_BATCH_BYTES,
        ge=1024 * 1024,
        description="a Kafka record batch a process fetches that decompresses past this (a "
        "compression bomb on a tenant's topic), or that it cannot decode, is skipped unread: "
        "logged with its topic, partition and offsets, and counted",
    )

    ingress_url: str = Field(
        "http://127.0.0.1:8000/v1",
        description="the CLI's batch commands: OpenAI base URL of an ingress; unset, the "
        "local stack's: http://127.0.0.1:LANEWAY_PORT/v1",
    )
    models: list[str] = Field(
        default_factory=lambda: ["laneway-code", "laneway-chat"],
        min_length=1,
        description="model names served (JSON list)",
    )
    # Checked against laneway's estimate (``laneway.tokens``), which counts punctuation at two
    # characters a token and so runs over a tokenizer's count for code: 32k and a quarter more.
    max_prompt_tokens: int = Field(
        40_960,
        gt=0,
        description="largest accepted prompt, by laneway's estimate (which runs over a model's "
        "own count for code: the default is 32k and a quarter more; a server behind laneway "
        "still refuses what is over its own context)",
    )
    completion_max_tokens: int = Field(128, gt=0, description="max_tokens cap of completions")
    chat_max_tokens: int = Field(4096, gt=0, description="max_tokens cap of chat")

    metrics_port: int = Field(
        0, ge=0, le=65535, description="workers and streams: serve /metrics here (0: off)"
    )
    prices: dict[str, Price] = Field(
        default_factory=_default_prices,
        description="cost per 1k tokens by route: {route: {prompt, cached, completion}}; "
        "'*' (required) prices the rest (JSON)",
    )

    quota_enabled: bool = Field(True, description="enforce team budgets")
    quota_unit_tokens: int = Field(1000, gt=0, description="tokens in one budget unit")
    quota_units_per_member: float = Field(
        50.0, gt=0, description="budget units per team member per hour"
    )
    quota_batch_ratio: float = Field(
        1.0, ge=0, description="batch pool size as a multiple of the interactive pool"
    )
    quota_offpeak: str = Field(
        "22:00-06:00",
        pattern=r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$|^$",
        description="UTC window when batch may borrow idle interactive budget ('' = never)",
    )
    quota_borrow_reserve: float = Field(
        0.3, ge=0, le=1, description="share of the interactive pool batch can never borrow"
    )
    quota_min_charge_tokens: int = Field(
        16,
        ge=0,
        description="tokens a request that used none costs its team: dropped before it ran "
        "(cancelled, superseded, expired), a flood of requests is still not free",
    )
    quota_max_excess: float = Field(
        1.0,
        ge=0,
        description="a request that used more tokens than it reserved (its prompt was longer "
        "than estimated) is charged at most this share of its reservation on top",
    )

    # Kafka authentication (docs/security.md): one principal per service, its ACLs say what
    # it may read and write.
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description="Kafka listener protocol: SASL_SSL in production, SASL_PLAINTEXT for the "
        "local secured mode (LANEWAY_SECURED), PLAINTEXT: no authentication",
    )
    kafka_sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = Field(
        "SCRAM-SHA-256",
        description="SASL mechanism of the Kafka principal (PLAIN: the compose admin only, "
        "whose login the brokers' own configuration holds)",
    )
    kafka_password: SecretStr = Field(
        SecretStr(""), description="password of LANEWAY_KAFKA_USERNAME (never logged)"
    )
    kafka_username: str = Field(
        "",
        validate_default=True,
        description="Kafka principal (SASL user) of this service",
    )
    kafka_ssl_cafile: str = Field(
        "", description="SASL_SSL: CA bundle that signed the brokers' certificates ('': system)"
    )

    @field_validator("prices")
    @classmethod
    def _every_route_priced(cls, prices: dict[str, Price]) -> dict[str, Price]:
        # Without it every route not named (a canary, a breaker's fallback) would cost 0,
        # unsaid, in every cost report.
        if "*" not in prices:
            raise ValueError(
                "needs a '*' entry, the price of every route it does not name "
                "('\"*\": {}' for free)"
            )
        return prices

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, value: str) -> str:
        # A Sentinel URL is read where its client is made (laneway.clients.sentinel_redis).
        if not value.startswith(("redis+sentinel://", "rediss+sentinel://")):
            try:
                parse_url(value)  # type: ignore[no-untyped-call]
            except ValueError:
                # Not redis-py's words: they may quote a piece of the password.
                raise ValueError(
                    "not a Redis URL: redis://, rediss:// or unix://, then host and port "
                    "(a password with '/', ':' or '@' in it URL-encoded)"
                ) from None
        return value

    @field_validator("kafka_username")
    @classmethod
    def _kafka_login_complete(cls, value: str, info: ValidationInfo) -> str:
        # On the user name, not the password: an error message shows the value it is about.
        protocol = info.data.get("kafka_security_protocol", "PLAINTEXT")
        password = info.data.get("kafka_password")
        if protocol != "PLAINTEXT" and not (value and password and password.get_secret_value()):
            raise ValueError(
                f"LANEWAY_KAFKA_SECURITY_PROTOCOL={protocol} needs LANEWAY_KAFKA_USERNAME and "
                "LANEWAY_KAFKA_PASSWORD (this service's principal)"
            )
        return value

    def price_of(self, route: str) -> Price:
        return self.prices.get(route) or self.prices.get("*") or Price()

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.redis_prefix)


S = TypeVar("S", bound=CommonSettings)


# Each service's settings class lives in its own package and is registered as an entry point
# of the group "laneway.settings" (pyproject.toml), so the shared core can list every setting
# (to refuse a misspelt variable) without importing a package above it.
SETTINGS_GROUP = "laneway.settings"


def settings_classes() -> dict[str, type[CommonSettings]]:
    """Every service's settings class by service name ("all" for the common ones)."""
    found: dict[str, type[CommonSettings]] = {"all": CommonSettings}
    for entry in sorted(entry_points(group=SETTINGS_GROUP), key=lambda e: e.name):
        found[entry.name] = entry.load()
    return found


def known_variables() -> set[str]:
    names = set(_OTHER_KNOWN_VARIABLES)
    for cls in settings_classes().values():
        names.update(f"LANEWAY_{field.upper()}" for field in cls.model_fields)
    return names


# Settings that went, and what took their place: a stack that still sets one is told.
RETIRED = {
    "LANEWAY_BATCH_MEMORY_HIGH": "LANEWAY_MEMORY_SHED_AT (memory pressure sheds the lo band "
    "as well as batch now)",
}


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Refuse ``LANEWAY_*`` variables that no service reads (typos, retired names)."""
    env = os.environ if environ is None else environ
    unknown = sorted(
        k for k in env if k.upper().startswith("LANEWAY_") and k.upper() not in known_variables()
    )
    if unknown:
        known = sorted(known_variables())
        hints = [
            f"{k} is now {RETIRED[k.upper()]}"
            if k.upper() in RETIRED
            else f"{k}: did you mean {close[0]}?"
            for k in unknown
            if k.upper() in RETIRED or (close := difflib.get_close_matches(k.upper(), known, 1))
        ]
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}: no laneway service reads them "
            "(see the settings table in README.md for the names)"
            + (f"; {'; '.join(hints)}" if hints else "")
        )


# Where Kafka, Redis and the ingress are when their addresses are not set: on the local
# stack's ports (`laneway up`'s LANEWAY_KAFKA_PORT, LANEWAY_REDIS_PORT and LANEWAY_PORT), so
# that a command run in the shell that started a stack on other ports reaches that stack.
_LOCAL_ADDRESSES = {
    "kafka_bootstrap": ("LANEWAY_KAFKA_PORT", "127.0.0.1:{}"),
    "redis_url": ("LANEWAY_REDIS_PORT", "redis://127.0.0.1:{}/0"),
    "ingress_url": ("LANEWAY_PORT", "http://127.0.0.1:{}/v1"),
}


def local_addresses(cls: type[BaseSettings], environ: Mapping[str, str]) -> dict[str, str]:
    """The addresses of ``cls`` that ``environ`` leaves unset but names a local stack's port
    for (a port of 0, "any free one", names none)."""
    env = {k.upper(): v for k, v in environ.items()}
    found = {}
    for field, (variable, address) in _LOCAL_ADDRESSES.items():
        if (
            field not in cls.model_fields
            or f"LANEWAY_{field.upper()}" in env
            or variable not in env
        ):
            continue
        port = env[variable].strip()
        if not (port.isascii() and port.isdecimal()) or int(port) > 65535:
            raise ConfigError(f"bad setting: {variable}={env[variable]!r}: not a port number")
        if int(port):
            found[field] = address.format(int(port))
    return found


def _refuse_nulls(cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
    """A JSON ``null`` for a list, map or number setting: pydantic-settings drops it, and
    the default would stand as if the variable were unset, with nothing said."""
    env = {k.upper(): v for k, v in environ.items()}
    for field, info in cls.model_fields.items():
        value = env.get(f"LANEWAY_{field.upper()}")
        if (
            value is not None
            and value.strip() == "null"
            and info.annotation not in (str, SecretStr)
        ):
            raise ConfigError(
                f"bad setting: LANEWAY_{field.upper()}=null: null is no value here; leave the "
                "variable unset for the default"
            )


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build ``cls`` from the environment plus ``overrides``; errors name the variable."""
    check_environment()
    _refuse_nulls(cls, os.environ)
    try:
        return cls(**{**local_addresses(cls, os.environ), **overrides})
    except SettingsError as exc:
        # A value that is not the JSON a list or map setting needs (pydantic-settings parses
        # it before validation, and names the field only in its message).
        named = re.search(r'field "([^"]+)"', str(exc))
        variable = f"LANEWAY_{named.group(1).upper()}" if named else "a LANEWAY_* variable"
        raise ConfigError(
            f"bad setting: {variable}: not valid JSON ({exc.__cause__ or exc})"
        ) from None
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            value = err.get("input")
            known = cls.model_fields.get(field)
            if known is not None and known.annotation is SecretStr:
                value = "(secret)"
            elif field == "redis_url":
                value = "(not shown: it may hold a password)"
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "string_pattern_mismatch" and known is not None:
                message = f"{message}: {known.description}"
            if not field:  # a check of several settings together: its message names them
                problems.append(message)
                continue
            problems.append(f"LANEWAY_{field.upper()}={value!r}: {message}")
        raise ConfigError("bad setting: " + "; ".join(problems)) from None


def settings_only(prog: str, description: str | None, argv: list[str] | None = None) -> None:
    """The command line of a service configured by ``LANEWAY_*`` variables alone: ``--help``
    says so, and any argument is refused (argparse exits 2) instead of being ignored."""
    argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Configured by LANEWAY_* environment variables only: README.md's settings "
        "table lists them.",
    ).parse_args(argv)
