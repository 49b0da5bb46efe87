"""Kafka ACLs and SCRAM credentials, set through the broker's admin protocol.

aiokafka 0.14 sends CreateAcls one binding per request and has no AlterUserScramCredentials
(KIP-554) at all, so the few request types are defined here, as ``group_members`` does for
the group protocol. A SCRAM credential is salted and hashed here (RFC 5802's ``Hi``): the
password itself never reaches the broker, a command line or a log.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.admin import (
    CreateAclsRequest_v1,
    DeleteAclsRequest_v1,
    DescribeAclsRequest_v1,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

from laneway.errors import ServiceError

__all__ = [
    "AclRule",
    "Operation",
    "Pattern",
    "ResourceType",
    "create_acls",
    "delete_acls",
    "delete_scram",
    "describe_acls",
    "has_scram",
    "scram_salted",
    "upsert_scram",
]

ResourceType = Literal["topic", "group", "cluster", "transactional_id"]
Operation = Literal[
    "all",
    "read",
    "write",
    "create",
    "delete",
    "alter",
    "describe",
    "describe_configs",
    "alter_configs",
]
Pattern = Literal["literal", "prefixed"]

# Kafka's wire codes (org.apache.kafka.common.{resource,acl}).
_RESOURCE = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
_PATTERN = {"literal": 3, "prefixed": 4}
_OPERATION = {
    "all": 2,
    "read": 3,
    "write": 4,
    "create": 5,
    "delete": 6,
    "alter": 7,
    "describe": 8,
    "describe_configs": 10,
    "alter_configs": 11,
}
_ANY = 1
_ALLOW = 3
_MECHANISMS = {"SCRAM-SHA-256": (1, "sha256"), "SCRAM-SHA-512": (2, "sha512")}
# Kafka's minimum for SCRAM-SHA-256 is 4096; 8192 is what kafka-configs uses by default.
_ITERATIONS = 8192


@dataclass(frozen=True, order=True)
class AclRule:
    """Allow ``principal`` (a SASL user name) ``operation`` on one resource or prefix."""

    principal: str
    resource: ResourceType
    name: str
    operation: Operation
    pattern: Pattern = "literal"

    def describe(self) -> str:
        star = "*" if self.pattern == "prefixed" else ""
        return f"User:{self.principal} {self.operation} {self.resource}:{self.name}{star}"


class _CreateAcls(Request[CreateAclsRequest_v1]):  # type: ignore[misc]
    """Every binding in one request (aiokafka's sends one)."""

    API_KEY = 30

    def __init__(self, rules: list[AclRule]) -> None:
        self.rules = rules

    def build(self, request_struct_class: type[CreateAclsRequest_v1]) -> Any:
        return request_struct_class(
            [
                (
                    _RESOURCE[r.resource],
                    r.name,
                    _PATTERN[r.pattern],
                    f"User:{r.principal}",
                    "*",
                    _OPERATION[r.operation],
                    _ALLOW,
                )
                for r in self.rules
            ]
        )


class _DescribeAcls(Request[DescribeAclsRequest_v1]):  # type: ignore[misc]
    """Every ACL of one principal."""

    API_KEY = 29

    def __init__(self, principal: str) -> None:
        self.principal = principal

    def build(self, request_struct_class: type[DescribeAclsRequest_v1]) -> Any:
        return request_struct_class(_ANY, None, _ANY, f"User:{self.principal}", None, _ANY, _ANY)


class _DeleteAcls(Request[DeleteAclsRequest_v1]):  # type: ignore[misc]
    API_KEY = 31

    def __init__(self, principal: str) -> None:
        self.principal = principal

    def build(self, request_struct_class: type[DeleteAclsRequest_v1]) -> Any:
        return request_struct_class(
            [(_ANY, None, _ANY, f"User:{self.principal}", None, _ANY, _ANY)]
        )


class _AlterScramResponseV0(Response):  # type: ignore[misc]
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            CompactArray(
                ("user", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScramRequestV0(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponseV0
    SCHEMA = Schema(
        (
            "deletions",
            CompactArray(
                ("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields)
            ),
        ),
        (
            "upsertions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("iterations", Int32),
                ("salt", CompactBytes),
                ("salted_password", CompactBytes),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScram(Request[_AlterScramRequestV0]):  # type: ignore[misc]
    API_KEY = 51

    def __init__(self, deletions: list[Any], upsertions: list[Any]) -> None:
        self.deletions = deletions
        self.upsertions = upsertions

    def build(self, request_struct_class: type[_AlterScramRequestV0]) -> Any:
        return request_struct_class(self.deletions, self.upsertions, {})


class _DescribeScramResponseV0(Response):  # type: ignore[misc]
    API_KEY = 50
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        ("error_message", CompactString("utf-8")),
        (
            "results",
            CompactArray(
                ("user", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                (
                    "credential_infos",
                    CompactArray(
                        ("mechanism", Int8), ("iterations", Int32), ("tags", TaggedFields)
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _DescribeScramRequestV0(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 50
    API_VERSION = 0
    RESPONSE_TYPE = _DescribeScramResponseV0
    SCHEMA = Schema(
        ("users", CompactArray(("name", CompactString("utf-8")), ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


class _DescribeScram(Request[_DescribeScramRequestV0]):  # type: ignore[misc]
    API_KEY = 50

    def __init__(self, user: str) -> None:
        self.user = user

    def build(self, request_struct_class: type[_DescribeScramRequestV0]) -> Any:
        return request_struct_class([(self.user, {})], {})


async def _send(admin: AIOKafkaAdminClient, request: Request[Any]) -> dict[str, Any]:
    # Any broker will do: KRaft forwards ACL and credential changes to the controller.
    response = await admin._send_request(request)  # aiokafka's one way in
    answer: dict[str, Any] = response.to_object()
    return answer


def _raise(code: int, message: str | None, what: str) -> None:
    if code:
        error = for_code(code)
        raise ServiceError(f"{what}: {error.__name__} ({message or error.description})")


async def create_acls(admin: AIOKafkaAdminClient, rules: list[AclRule]) -> None:
    """Add ``rules`` (already present ones are left as they are)."""
    if not rules:
        return
    answer = await _send(admin, _CreateAcls(rules))
    for rule, result in zip(rules, answer["creation_responses"], strict=True):
        _raise(result["error_code"], result["error_message"], f"ACL {rule.describe()}")


async def describe_acls(admin: AIOKafkaAdminClient, principal: str) -> list[AclRule]:
    """The ALLOW rules of ``principal``, sorted."""
    answer = await _send(admin, _DescribeAcls(principal))
    _raise(answer["error_code"], answer["error_message"], f"ACLs of {principal}")
    resources = {code: name for name, code in _RESOURCE.items()}
    patterns = {code: name for name, code in _PATTERN.items()}
    operations = {code: name for name, code in _OPERATION.items()}
    return sorted(
        AclRule(
            principal,
            resources[resource["resource_type"]],  # type: ignore[arg-type]
            resource["resource_name"],
            operations[acl["operation"]],  # type: ignore[arg-type]
            patterns[resource["resource_pattern_type"]],  # type: ignore[arg-type]
        )
        for resource in answer["resources"]
        for acl in resource["acls"]
        if acl["permission_type"] == _ALLOW
    )


async def delete_acls(admin: AIOKafkaAdminClient, principal: str) -> int:
    """Remove every ACL of ``principal``; how many there were."""
    answer = await _send(admin, _DeleteAcls(principal))
    (result,) = answer["filter_responses"]
    _raise(result["error_code"], result["error_message"], f"deleting ACLs of {principal}")
    return len(result["matching_acls"])


def scram_salted(password: str, mechanism: str = "SCRAM-SHA-256") -> tuple[bytes, bytes, int]:
    """(salt, salted password, iterations) of a new SCRAM credential (RFC 5802's Hi)."""
    salt = secrets.token_bytes(32)
    digest = _MECHANISMS[mechanism][1]
    return salt, hashlib.pbkdf2_hmac(digest, password.encode(), salt, _ITERATIONS), _ITERATIONS


async def upsert_scram(
    admin: AIOKafkaAdminClient, user: str, password: str, mechanism: str = "SCRAM-SHA-256"
) -> None:
    """Create or replace ``user``'s SCRAM credential for ``mechanism``."""
    salt, salted, iterations = scram_salted(password, mechanism)
    code = _MECHANISMS[mechanism][0]
    answer = await _send(admin, _AlterScram([], [(user, code, iterations, salt, salted, {})]))
    for result in answer["results"]:
        _raise(result["error_code"], result["error_message"], f"SCRAM credential of {user}")


async def has_scram(admin: AIOKafkaAdminClient, user: str) -> bool:
    """Whether ``user`` has a SCRAM credential (of any mechanism) on the broker."""
    answer = await _send(admin, _DescribeScram(user))
    _raise(answer["error_code"], answer["error_message"], "SCRAM credentials")
    for result in answer["results"]:
        if result["error_code"] == 91:  # RESOURCE_NOT_FOUND: no such credential
            return False
        _raise(result["error_code"], result["error_message"], f"SCRAM credential of {user}")
        return bool(result["credential_infos"])
    return False


async def delete_scram(
    admin: AIOKafkaAdminClient, user: str, mechanism: str = "SCRAM-SHA-256"
) -> bool:
    """Remove ``user``'s credential; False when it had none."""
    code = _MECHANISMS[mechanism][0]
    answer = await _send(admin, _AlterScram([(user, code, {})], []))
    for result in answer["results"]:
        if result["error_code"] == 91:  # RESOURCE_NOT_FOUND: no such credential
            return False
        _raise(result["error_code"], result["error_message"], f"SCRAM credential of {user}")
    return True
