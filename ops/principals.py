"""Kafka principals of laneway and exactly what each may reach (the table in docs/security.md).

A role is what a principal is for: ``ingress``, ``worker:<pool>``, ``streams``,
``tenant:<team>`` (a team that submits batch work straight to Kafka) or ``analyst``. The rules
below are read off the code: which process produces to and consumes from which topic, under
which consumer group and transactional id. Everything not listed is refused: the broker runs
with ``allow.everyone.if.no.acl.found=false``.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass
from typing import get_args

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError
from pydantic import SecretStr

from laneway.batch import submit_transactional_id
from laneway.clients import kafka_auth, make_admin
from laneway.constants import POOLS, RequestClass, Topics
from laneway.errors import ConfigError, ServiceError
from laneway.kafka_acl import (
    AclRule,
    Operation,
    Pattern,
    ResourceType,
    create_acls,
    delete_acls,
    delete_scram,
    describe_acls,
    has_scram,
    upsert_scram,
)
from laneway.settings import CommonSettings
from ops.kafka_topics import create_topics_async

__all__ = ["ROLES", "Role", "acl_rules", "create_principal", "delete_principal", "show_acls"]

ROLES = ("ingress", "worker:<pool>", "streams", "tenant:<team>", "analyst", "batch-service")
# A team name becomes part of two topic names (Kafka: [A-Za-z0-9._-], 249 characters); no dot,
# so one team's topic can never be a prefix-match of another's.
_TEAM = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,200}$")


@dataclass(frozen=True)
class Role:
    kind: str  # ingress, worker, streams, tenant, analyst
    arg: str = ""  # the pool of a worker, the team of a tenant

    @classmethod
    def parse(cls, text: str) -> Role:
        kind, _, arg = text.partition(":")
        if kind in ("ingress", "streams", "analyst", "batch-service") and not arg:
            return cls(kind)
        if kind == "worker" and arg in get_args(RequestClass):
            return cls(kind, arg)
        if kind == "tenant" and _TEAM.match(arg):
            return cls(kind, arg)
        raise ConfigError(
            f"role {text!r} is not one of {', '.join(ROLES)} (pool: {', '.join(POOLS)}; team: "
            "letters, digits, '_' and '-', at most 100)"
        )

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


_READS: tuple[Operation, ...] = ("read", "describe")
_WRITES: tuple[Operation, ...] = ("write", "describe")
_GROUP: tuple[Operation, ...] = ("read",)


def _on(
    principal: str,
    resource: ResourceType,
    names: list[str],
    ops: tuple[Operation, ...],
    pattern: Pattern = "literal",
) -> list[AclRule]:
    return [AclRule(principal, resource, name, op, pattern) for name in names for op in ops]


def acl_rules(
    principal: str, role: Role, topics: Topics, *, streams_app_id: str = ""
) -> list[AclRule]:
    """The ALLOW rules of ``principal`` acting as ``role``, sorted."""
    reads, writes = _READS, _WRITES

    def topic(
        names: list[str], ops: tuple[Operation, ...], pattern: Pattern = "literal"
    ) -> list[AclRule]:
        return _on(principal, "topic", names, ops, pattern)

    rules: list[AclRule] = []
    if role.kind == "ingress":
        interactive = [t for pool in ("completion", "chat") for t in topics.pool_topics(pool)]
        # The HTTP Batches API writes each job's lines with the team of the caller's key to
        # req.batch.http and its header on results.batch.http, in one transaction per batch
        # (ingress/batch_submission.py); no other principal writes or reads those two. Its
        # files live on <prefix>.files. req.batch and results.batch: the batch probe.
        files = topics.files
        http = [topics.batch_http, topics.results_batch_http]
        rules += topic([*interactive, topics.request("batch"), topics.cancel, *http], writes)
        rules += topic([topics.control, topics.keys, files, topics.results_batch], writes)
        txn = f"{topics.prefix}.batches."
        rules += _on(principal, "transactional_id", [txn], writes, "prefixed")
        # Reply chunks while Redis is away, revocations, batch results (probe and Batches API),
        # and what the operator's console shows (rollups, breaker and probe records).
        rules += topic([topics.replies, topics.keys, topics.results_batch, files], reads)
        rules += topic([topics.results_batch_http], reads)
        rules += topic([topics.usage_hourly, topics.control], reads)
    elif role.kind == "worker":
        pool: RequestClass = role.arg  # type: ignore[assignment]
        group = topics.consumer_group(pool)
        rules += _on(principal, "group", [group], _GROUP)
        rules += topic([topics.cancel], reads)
        rules += topic([topics.replies, topics.usage, topics.control], writes)
        if pool == "batch":
            # The lane and every tenant's batch topic (one prefix), read only: a line shed
            # under memory pressure waits in its worker, its offset uncommitted.
            lane = topics.request("batch")
            rules += topic([lane], ("read", "describe"), "prefixed")
            rules += topic([topics.results_batch, topics.results_batch_http], writes)
            rules += topic([topics.results_batch_team("")], writes, "prefixed")
            # One transactional id per input partition (workers/batch_txn.py).
            txn = f"{topics.prefix}.batch.{group}."
            rules += _on(principal, "transactional_id", [txn], writes, "prefixed")
        else:
            rules += topic(topics.pool_topics(pool), reads)
    elif role.kind == "streams":
        app_id = streams_app_id or f"{topics.prefix}-streams"
        rules += _on(principal, "group", [app_id], _GROUP)
        rules += topic([topics.usage], reads)
        rules += topic([topics.control, topics.usage_hourly], writes)
        # Faust's table changelogs and its assignor topic, which it creates itself (and
        # keeps compact: ``streams.changelogs.CHANGELOG_CONFIGS``).
        rules += topic(
            [f"{app_id}-"],
            ("create", "read", "write", "describe", "describe_configs", "alter_configs"),
            "prefixed",
        )
    elif role.kind == "tenant":
        team = role.arg
        rules += topic([topics.batch_team(team)], writes)
        rules += topic([topics.results_batch_team(team)], reads)
        # Consumer groups of its own for reading its results, under one prefix.
        rules += _on(principal, "group", [f"{topics.prefix}.team.{team}."], _GROUP, "prefixed")
    elif role.kind == "batch-service":
        # A pipeline the operator runs for teams (`laneway batch submit --kafka --team T`): the
        # `team` of its lines is trusted, so it is an operator's principal, never a tenant's.
        rules += topic([topics.request("batch"), topics.results_batch], writes)
        rules += topic([topics.results_batch], reads)
        # A job's lines and header in one transaction (``laneway.batch.BatchClient.submit``).
        txn = submit_transactional_id(topics, "")
        rules += _on(principal, "transactional_id", [txn], writes, "prefixed")
    elif role.kind == "analyst":
        rules += topic([topics.usage, topics.usage_hourly], reads)
        rules += _on(principal, "group", [f"{topics.prefix}.analyst."], _GROUP, "prefixed")
    return sorted(set(rules))


def _scram(settings: CommonSettings) -> str:
    """The SCRAM mechanism principals get: the admin's own, unless it logs in with PLAIN."""
    mechanism = settings.kafka_sasl_mechanism
    return mechanism if mechanism.startswith("SCRAM-") else "SCRAM-SHA-256"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ConfigError(
            f"principal name {name!r}: letters, digits and . _ @ -, at most 200 characters"
        )


async def create_principal(
    settings: CommonSettings,
    name: str,
    role: Role,
    *,
    password: str = "",
    partitions: int = 3,
    replication: int = 1,
    streams_app_id: str = "",
    replace: bool = False,
) -> str:
    """Create (or replace) the SCRAM credential of ``name`` and add its role's ACLs; for a
    tenant, its two topics too. Runs as the settings' (admin) principal; returns the password.
    A name holding laneway's ACLs of this role gets a new password; the admin's own name is
    refused, and so is any other login that holds no ACLs unless ``replace``.
    """
    _check_name(name)
    password = password or secrets.token_urlsafe(24)
    topics = settings.topics
    rules = acl_rules(name, role, topics, streams_app_id=streams_app_id)
    admin = make_admin(settings, request_timeout_ms=15_000)
    await admin.start()
    try:
        # ACLs are only ever added: created again under another role (another team), the
        # principal would keep the old role's rights beside the new ones.
        held = set(await describe_acls(admin, name))
        other = sorted(held - set(rules))
        if name == settings.kafka_username:
            raise ConfigError(
                f"principal {name!r} is the one this command runs as (the admin): its password "
                "would be replaced by a tenant's or a service's; choose another name"
            )
        if not held and not replace and await has_scram(admin, name):
            # A login that laneway gave no ACLs: a super user (super.users needs none) or one
            # made outside laneway. Replacing its password would hand its rights to this role.
            raise ConfigError(
                f"principal {name!r} exists and holds no ACLs of laneway's (a super user, or "
                "made outside laneway): creating it would replace its password; choose another "
                "name, or pass --replace if that is what you mean"
            )
        if other:
            raise ConfigError(
                f"principal {name!r} holds {len(other)} ACLs its role {role} does not grant "
                f"(e.g. {other[0].describe()}): a principal has one role; `laneway principals "
                f"delete {name}` first, then create it again"
            )
        if role.kind == "tenant":
            await create_topics_async(
                settings, topics.team_specs(role.arg, partitions), replication=replication
            )
        await upsert_scram(admin, name, password, _scram(settings))
        await create_acls(admin, rules)
        # The controller has them; the broker applies them a moment later.
        await _until_applied(admin, name, rules)
    finally:
        await admin.close()
    await _until_login(settings, name, password)
    return password


async def _until_applied(
    admin: AIOKafkaAdminClient, name: str, rules: list[AclRule], within_s: float = 15.0
) -> None:
    deadline = time.monotonic() + within_s
    while not set(rules) <= set(await describe_acls(admin, name)):
        if time.monotonic() > deadline:
            raise ServiceError(f"the broker did not apply the ACLs of {name} within {within_s}s")
        await asyncio.sleep(0.1)


async def _until_login(
    settings: CommonSettings, name: str, password: str, within_s: float = 15.0
) -> None:
    """Return once ``name`` can log in (its credential reached the broker)."""
    as_new = settings.model_copy(
        update={
            "kafka_username": name,
            "kafka_password": SecretStr(password),
            "kafka_sasl_mechanism": _scram(settings),
        }
    )
    deadline = time.monotonic() + within_s
    while True:
        client = AIOKafkaClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(as_new))
        try:
            await client.bootstrap()
        except KafkaError:
            if time.monotonic() > deadline:
                raise ServiceError(f"{name} could not log in within {within_s}s") from None
            await asyncio.sleep(0.1)
        else:
            return
        finally:
            await client.close()


async def delete_principal(settings: CommonSettings, name: str) -> tuple[bool, int]:
    """Remove ``name``'s credential and every ACL of it: (had a credential, ACLs removed)."""
    _check_name(name)
    admin = make_admin(settings)
    await admin.start()
    try:
        had = await delete_scram(admin, name, _scram(settings))
        removed = await delete_acls(admin, name)
    finally:
        await admin.close()
    return had, removed


async def show_acls(settings: CommonSettings, name: str) -> list[AclRule]:
    """The ACLs the broker holds for ``name``."""
    _check_name(name)
    admin = make_admin(settings)
    await admin.start()
    try:
        return await describe_acls(admin, name)
    finally:
        await admin.close()
