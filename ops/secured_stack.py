"""``laneway up`` in the secured mode (``LANEWAY_SECURED=true``): Kafka with SASL/SCRAM and
ACLs, Redis with ACL users, and every service logged in as a principal of its own.

Passwords are generated once into ``<data dir>/secrets/stack.json`` (mode 0600) and reused on
every start, since the broker and Redis keep what they were given. The operator's credentials
(the Kafka admin, Redis's operator user) are written to ``<data dir>/secrets/admin.env`` for
the CLI: ``set -a; . .run/secrets/admin.env; set +a``.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from pathlib import Path

import orjson
from pydantic import SecretStr

from laneway.constants import POOLS
from laneway.settings import CommonSettings
from ops.broker_admin import BrokerAdmin
from ops.kafka_broker import KafkaBroker
from ops.principals import Role, create_principal
from ops.redis_server import RedisServer, RedisUser
from ops.settings import StackSettings

__all__ = ["StackSecrets", "service_identity", "stack_secrets"]

_ADMIN = "admin"
_OPERATOR = "operator"  # Redis: the CLI's user (keys, teams); every key and command


def service_identity(service: str, pool: str = "") -> tuple[str, Role, str]:
    """(Kafka principal, its role, Redis user) of a service of the stack."""
    if service == "worker":
        return f"worker-{pool}", Role("worker", pool), "worker"
    return service, Role(service), service


def _principals() -> list[tuple[str, Role, str]]:
    return [
        service_identity("ingress"),
        *(service_identity("worker", pool) for pool in POOLS),
        service_identity("streams"),
    ]


@dataclass(frozen=True)
class StackSecrets:
    """Passwords of the secured stack: Kafka principals and Redis users, by name."""

    directory: Path
    kafka: dict[str, str]
    redis: dict[str, str]

    @classmethod
    def load_or_create(cls, directory: Path) -> StackSecrets:
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / "stack.json"
        stored = orjson.loads(path.read_bytes()) if path.is_file() else {}
        kafka = dict(stored.get("kafka", {}))
        redis = dict(stored.get("redis", {}))
        for name in [_ADMIN, *(principal for principal, _, _ in _principals())]:
            kafka.setdefault(name, secrets.token_urlsafe(24))
        for user in [_OPERATOR, *(user for _, _, user in _principals())]:
            redis.setdefault(user, secrets.token_urlsafe(24))
        path.touch()
        path.chmod(0o600)
        path.write_bytes(orjson.dumps({"kafka": kafka, "redis": redis}, option=orjson.OPT_INDENT_2))
        return cls(directory, kafka, redis)

    @property
    def kafka_admin(self) -> BrokerAdmin:
        return BrokerAdmin(_ADMIN, self.kafka[_ADMIN])

    def redis_users(self, prefix: str) -> list[RedisUser]:
        users = [RedisUser(_OPERATOR, self.redis[_OPERATOR], admin=True)]
        users += [
            RedisUser(name, password, prefix=prefix)
            for name, password in self.redis.items()
            if name != _OPERATOR
        ]
        return users

    def operator_redis_url(self, redis: RedisServer) -> str:
        return redis.url_of(RedisUser(_OPERATOR, self.redis[_OPERATOR]))

    def service_env(self, service: str, redis: RedisServer, pool: str = "") -> dict[str, str]:
        """The ``LANEWAY_*`` settings that log a service in as its principal and Redis user."""
        principal, _, user = service_identity(service, pool)
        return {
            "LANEWAY_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "LANEWAY_KAFKA_SASL_MECHANISM": self.kafka_admin.mechanism,
            "LANEWAY_KAFKA_USERNAME": principal,
            "LANEWAY_KAFKA_PASSWORD": self.kafka[principal],
            "LANEWAY_REDIS_URL": redis.url_of(RedisUser(user, self.redis[user])),
        }

    def write_admin_env(self, kafka: KafkaBroker, redis: RedisServer) -> Path:
        path = self.directory / "admin.env"
        path.touch()
        path.chmod(0o600)
        lines = {
            "LANEWAY_KAFKA_BOOTSTRAP": kafka.bootstrap,
            "LANEWAY_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "LANEWAY_KAFKA_USERNAME": _ADMIN,
            "LANEWAY_KAFKA_PASSWORD": self.kafka[_ADMIN],
            "LANEWAY_REDIS_URL": self.operator_redis_url(redis),
        }
        path.write_text("".join(f"{key}={value}\n" for key, value in lines.items()))
        return path

    def ensure_principals(self, settings: CommonSettings, kafka: KafkaBroker) -> None:
        """Create (or refresh) every service's credential and ACLs, as the admin."""
        admin = settings.model_copy(
            update={
                "kafka_bootstrap": kafka.bootstrap,
                "kafka_security_protocol": "SASL_PLAINTEXT",
                "kafka_username": _ADMIN,
                "kafka_password": SecretStr(self.kafka[_ADMIN]),
            }
        )

        async def create_all() -> None:
            for principal, role, _ in _principals():
                await create_principal(
                    admin, principal, role, password=self.kafka[principal], replace=True
                )

        # Called on the supervisor's start-up thread, where no event loop runs.
        asyncio.run(create_all())


def stack_secrets(settings: StackSettings) -> StackSecrets | None:
    """The secured mode's passwords (generated on first use), or None when it is off."""
    if not settings.secured:
        return None
    return StackSecrets.load_or_create(Path(settings.data_dir).resolve() / "secrets")
