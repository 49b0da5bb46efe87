"""A local Redis server, throwaway or persistent, and in the secured mode its ACL users."""

from __future__ import annotations

import hashlib
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from laneway.errors import ServiceError
from ops.devstack import ServerProcess

__all__ = ["RedisServer", "RedisUser", "redis_acl_file"]


@dataclass(frozen=True)
class RedisUser:
    """A Redis ACL user: a service (its keys and channels under laneway's prefix, no admin
    or dangerous commands) or, with ``admin``, the operator's (everything)."""

    name: str
    password: str = field(repr=False)
    prefix: str = "laneway"
    admin: bool = False

    def acl_line(self) -> str:
        # Only the password's SHA-256 is stored in the file.
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        if self.admin:
            rules = "~* &* +@all"
        else:
            rules = f"~{self.prefix}:* &{self.prefix}:* +@all -@admin -@dangerous"
        return f"user {self.name} on #{digest} {rules}"


def redis_acl_file(users: Sequence[RedisUser]) -> str:
    """A Redis ACL file: ``users`` and the default user off."""
    # Spelt out: a file that left the default user out would leave it on, with no password.
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    return "".join(line + "\n" for line in lines + [user.acl_line() for user in users])


class RedisServer(ServerProcess):
    """A Redis bound to 127.0.0.1: throwaway, or ``persistent`` (an append-only file in
    ``data_dir``, so API keys, team records and quota buckets outlive a crash and a restart).

    ``maxmemory`` bounds it with policy ``noeviction``: full, it refuses writes (an error
    laneway reports) rather than silently forget a quota bucket or a key (docs/security.md).
    """

    name = "redis"
    port_setting = "LANEWAY_REDIS_PORT"
    cmdline_marker = b"redis-server"

    def __init__(
        self,
        *,
        port: int,
        data_dir: Path,
        persistent: bool = False,
        maxmemory: str = "1gb",
        users: Sequence[RedisUser] = (),
    ) -> None:
        super().__init__(port=port, data_dir=data_dir)
        self.persistent = persistent
        self.maxmemory = maxmemory
        self.url = f"redis://127.0.0.1:{port}/0"
        # Secured mode: these ACL users, the default user off (no password, no access).
        self.users = tuple(users)

    def url_of(self, user: RedisUser) -> str:
        """The Redis URL that logs in as ``user``."""
        return f"redis://{quote(user.name)}:{quote(user.password, safe='')}@127.0.0.1:{self.port}/0"

    def _acl_file(self) -> Path:
        path = self.data_dir / "users.acl"
        path.touch()
        path.chmod(0o600)
        path.write_text(redis_acl_file(self.users))
        return path

    def start(self, timeout: float = 20.0) -> None:
        """Start redis-server and wait until it answers PING."""
        if self.running:
            return
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).is_file():
            raise ServiceError("redis-server is not installed: apt-get install redis-server")
        self._check_port_free(self.port, "Redis")
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "save": "",
            # Every write is on disk within a second: a killed server loses at most that.
            "appendonly": "yes" if self.persistent else "no",
            "appendfsync": "everysec",
            "maxmemory": self.maxmemory,
            "maxmemory-policy": "noeviction",
            "daemonize": "no",
            "logfile": "",  # stdout, i.e. redis.log, next to any start-up error
        }
        if self.users:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            options["aclfile"] = str(self._acl_file())
        self._spawn(
            [binary, *(arg for key, value in options.items() for arg in (f"--{key}", value))]
        )
        self._wait_ready(timeout)

    def _probe(self) -> tuple[bool, str]:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
        except OSError as exc:
            return False, str(exc)
        # With ACL users a PING without AUTH is refused, by a server that is up all the same.
        ready = reply.startswith((b"+PONG", b"-NOAUTH"))
        return ready, reply.decode(errors="replace").strip()
