"""The secured test pair: Kafka with SASL/SCRAM and ACLs, Redis with ACL users.

Each test makes principals of its own (named after its prefix) with ``ops.principals``,
the code ``laneway principals create`` runs; the Redis users are made once per session.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from laneway.settings import CommonSettings
from ops.broker_admin import BrokerAdmin
from ops.kafka_broker import KafkaBroker
from ops.principals import Role, create_principal
from ops.redis_server import RedisServer, RedisUser
from tests.stack import PARTITIONS, LiveStack, Services

# Every test prefix starts with "t": a service user may touch the keys of any test's prefix.
_TEST_PREFIXES = "t*"
REDIS_SERVICES = ("ingress", "worker", "streams")


@dataclass
class SecuredServices:
    kafka_admin: BrokerAdmin
    redis_users: list[RedisUser]
    services: Services | None = None
    redis: RedisServer | None = field(default=None, repr=False)

    @classmethod
    def generate(cls) -> SecuredServices:
        users = [
            RedisUser(name, secrets.token_urlsafe(16), prefix=_TEST_PREFIXES)
            for name in REDIS_SERVICES
        ]
        users.append(RedisUser("operator", secrets.token_urlsafe(16), admin=True))
        return cls(BrokerAdmin("admin", secrets.token_urlsafe(16)), users)

    def started(self, kafka: KafkaBroker, redis: RedisServer) -> SecuredServices:
        operator = next(u for u in self.redis_users if u.admin)
        self.redis = redis
        self.services = Services(kafka.bootstrap, redis.url_of(operator), kafka.auth)
        return self

    def redis_url(self, user: str) -> str:
        assert self.redis is not None
        return self.redis.url_of(next(u for u in self.redis_users if u.name == user))

    @property
    def anonymous_redis_url(self) -> str:
        assert self.redis is not None
        return self.redis.url


class Principals:
    """Principals of one test, named ``<prefix>-<name>``, and the settings that use them."""

    def __init__(self, secured: SecuredServices, stack: LiveStack) -> None:
        self.secured = secured
        self.stack = stack
        self.passwords: dict[str, str] = {}

    async def create(self, name: str, role: str) -> str:
        principal = f"{self.stack.prefix}-{name}"
        admin = CommonSettings(**self.stack.common)
        self.passwords[name] = await create_principal(
            admin, principal, Role.parse(role), partitions=PARTITIONS
        )
        return principal

    def settings(self, name: str, redis_user: str | None = None) -> dict[str, Any]:
        """Settings fields of a component that logs in as ``name`` (and ``redis_user``)."""
        fields: dict[str, Any] = {
            "kafka_security_protocol": "SASL_PLAINTEXT",
            "kafka_username": f"{self.stack.prefix}-{name}",
            "kafka_password": self.passwords[name],
        }
        if redis_user is not None:
            fields["redis_url"] = self.secured.redis_url(redis_user)
        return fields

    def auth(self, name: str) -> dict[str, Any]:
        """aiokafka options of a plain client that logs in as ``name``."""
        return {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-256",
            "sasl_plain_username": f"{self.stack.prefix}-{name}",
            "sasl_plain_password": self.passwords[name],
        }
