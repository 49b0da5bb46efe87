"""The super user of a secured local broker: its SASL settings and the credential its storage
is formatted with."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laneway.errors import ServiceError
from laneway.kafka_acl import scram_salted

__all__ = ["BrokerAdmin"]


@dataclass(frozen=True)
class BrokerAdmin:
    """The super user of a secured broker: SASL/SCRAM on the client listener (the one every
    client and the broker itself use), SASL/PLAIN on the controller listener (KRaft reads no
    SCRAM credential there), the ACL authorizer on, nothing allowed that no ACL allows."""

    username: str
    password: str = field(repr=False)
    mechanism: str = "SCRAM-SHA-256"

    _MARKER = "laneway-sasl-admin"

    @property
    def auth(self) -> dict[str, Any]:
        return {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": self.mechanism,
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password,
        }

    def broker_properties(self, bootstrap: str, controller: str) -> dict[str, str]:
        user, secret, mechanism = self.username, self.password, self.mechanism
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule"
        plain = "org.apache.kafka.common.security.plain.PlainLoginModule"
        return {
            "listeners": f"CLIENT://{bootstrap},CONTROLLER://{controller}",
            "advertised.listeners": f"CLIENT://{bootstrap}",
            "inter.broker.listener.name": "CLIENT",
            "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "listener.name.client.sasl.enabled.mechanisms": mechanism,
            f"listener.name.client.{mechanism.lower()}.sasl.jaas.config": (
                f'{scram} required username="{user}" password="{secret}";'
            ),
            "sasl.mechanism.inter.broker.protocol": mechanism,
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                f'{plain} required username="{user}" password="{secret}" user_{user}="{secret}";'
            ),
            "sasl.mechanism.controller.protocol": "PLAIN",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{user}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def format_args(self) -> list[str]:
        """``kafka-storage format --add-scram`` with the salted password, not the password
        (the command line is visible to every local user while it runs)."""
        salt, salted, iterations = scram_salted(self.password, self.mechanism)
        encode = base64.b64encode
        return [
            "--add-scram",
            f"{self.mechanism}=[name={self.username},iterations={iterations},"
            f'salt="{encode(salt).decode()}",saltedpassword="{encode(salted).decode()}"]',
        ]

    def _fingerprint(self) -> str:
        return f"{self.username} {hashlib.sha256(self.password.encode()).hexdigest()}"

    def mark_formatted(self, log_dir: Path) -> None:
        (log_dir / self._MARKER).write_text(self._fingerprint())

    def check_formatted(self, log_dir: Path) -> None:
        """Refuse storage formatted without this admin (or with another password): the
        broker could not log in to itself, nor anyone administer it."""
        if not (log_dir / "meta.properties").is_file():
            return
        marker = log_dir / self._MARKER
        found = marker.read_text().strip() if marker.is_file() else None
        if found == self._fingerprint():
            return
        if found is None:
            why = "without SASL"
        elif found.split()[0] != self.username:
            why = f"with admin {found.split()[0]!r}"
        else:
            why = "with another admin password (were its secrets lost?)"
        raise ServiceError(
            f"the Kafka data in {log_dir} was formatted {why}, so admin {self.username!r} "
            "cannot log in; secured mode needs its own data: remove that directory (its "
            "topics are lost) or use another LANEWAY_DATA_DIR"
        )
