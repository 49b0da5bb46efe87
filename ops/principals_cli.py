"""``laneway principals create|acls|delete``: Kafka principals and their ACLs (as the admin)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiokafka.errors import KafkaError

from laneway.arguments import int_from
from laneway.errors import ServiceError
from laneway.settings import load_settings
from ops.principals import ROLES, Role, create_principal, delete_principal, show_acls
from ops.settings import StackSettings

__all__ = ["add_principal_commands"]

_T = TypeVar("_T")


def _admin_settings() -> StackSettings:
    settings = load_settings(StackSettings)
    if settings.kafka_security_protocol == "PLAINTEXT":
        raise ServiceError(
            "principals are managed as the Kafka admin principal: set "
            "LANEWAY_KAFKA_SECURITY_PROTOCOL, LANEWAY_KAFKA_USERNAME and LANEWAY_KAFKA_PASSWORD "
            "(`laneway up` with LANEWAY_SECURED=true keeps them in <data dir>/secrets/admin.env)"
        )
    return settings


def _run(work: Coroutine[Any, Any, _T]) -> _T:
    try:
        return asyncio.run(work)
    except KafkaError as exc:
        raise ServiceError(f"Kafka refused or did not answer: {exc}") from exc


def cmd_create(args: argparse.Namespace) -> int:
    settings = _admin_settings()
    role = Role.parse(args.role)
    password = ""
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
        if len(password) < 12:
            raise ServiceError("a password read from stdin must have at least 12 characters")
    secret = _run(
        create_principal(
            settings,
            args.name,
            role,
            password=password,
            partitions=args.partitions or settings.partitions,
            replication=settings.replication_factor,
            streams_app_id=args.streams_app_id or os.environ.get("LANEWAY_STREAMS_APP_ID", ""),
            replace=args.replace,
        )
    )
    mechanism = (
        "SCRAM-SHA-256"
        if settings.kafka_sasl_mechanism == "PLAIN"
        else settings.kafka_sasl_mechanism
    )
    print(f"principal {args.name!r} ({role}) can now log in with SASL {mechanism}")
    if role.kind == "tenant":
        topics = settings.topics
        print(f"  writes batch lines to {topics.batch_team(role.arg)}")
        print(f"  reads its results from {topics.results_batch_team(role.arg)}")
    if not password:
        print("its password is shown once:")
        print(secret)
    return 0


def cmd_acls(args: argparse.Namespace) -> int:
    rules = _run(show_acls(_admin_settings(), args.name))
    for rule in rules:
        print(rule.describe())
    if not rules:
        print(f"no ACLs of {args.name!r}", file=sys.stderr)
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    had, removed = _run(delete_principal(_admin_settings(), args.name))
    print(f"{args.name!r}: credential {'removed' if had else 'absent'}, {removed} ACLs removed")
    return 0


def add_principal_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    principals = sub.add_parser(
        "principals", help="Kafka principals (SASL/SCRAM users) and their ACLs"
    ).add_subparsers(dest="principals_command", required=True)
    create = principals.add_parser(
        "create",
        help="create or replace a principal's credential and add its role's ACLs "
        "(the generated password is printed on the last line)",
    )
    create.add_argument("name")
    create.add_argument("--role", required=True, help=" | ".join(ROLES))
    create.add_argument(
        "--password-stdin", action="store_true", help="read the password from stdin"
    )
    create.add_argument(
        "--partitions",
        type=int_from(0, 256),
        default=0,
        help="tenant: partitions of its two topics (0: LANEWAY_PARTITIONS)",
    )
    create.add_argument(
        "--streams-app-id", default="", help="streams: the Faust app id (LANEWAY_STREAMS_APP_ID)"
    )
    create.add_argument(
        "--replace",
        action="store_true",
        help="replace the password of a login that holds no ACLs of laneway's (refused "
        "otherwise: it may be a super user)",
    )
    create.set_defaults(func=cmd_create)
    acls = principals.add_parser("acls", help="the ACLs the broker holds for a principal")
    acls.add_argument("name")
    acls.set_defaults(func=cmd_acls)
    delete = principals.add_parser("delete", help="remove a principal's credential and ACLs")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_delete)
