"""Write compose/.env (a password per service, kept where one is there already) and
compose/redis/users.acl (Redis ACL users from those passwords, stored as SHA-256 hashes).

    .venv/bin/python scripts/compose_secrets.py [compose-dir]

Both files stay out of git. Running it again keeps every password; delete a line of .env to
have that one generated anew (and re-run topic-init for a Kafka principal's).
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from ops.redis_server import RedisUser, redis_acl_file

KAFKA = ("ADMIN", "INGRESS", "WORKER_COMPLETION", "WORKER_CHAT", "WORKER_BATCH", "STREAMS")
REDIS = ("OPERATOR", "INGRESS", "WORKER", "STREAMS")
PREFIX = "laneway"  # LANEWAY_REDIS_PREFIX in docker-compose.yml


def _read_env(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    path.chmod(0o600)
    path.write_text(text)


def main(compose: Path) -> int:
    env_path = compose / ".env"
    env = _read_env(env_path)
    wanted = [f"KAFKA_{name}_PASSWORD" for name in KAFKA]
    wanted += [f"REDIS_{name}_PASSWORD" for name in REDIS]
    wanted.append("GRAFANA_ADMIN_PASSWORD")
    for key in wanted:
        # Hex: safe inside a URL (LANEWAY_REDIS_URL) and a JAAS string.
        env.setdefault(key, secrets.token_hex(24))
    _private(env_path, "".join(f"{key}={value}\n" for key, value in env.items()))
    users = [
        RedisUser(
            name.lower(),
            env[f"REDIS_{name}_PASSWORD"],
            prefix=PREFIX,
            admin=name == "OPERATOR",
        )
        for name in REDIS
    ]
    _private(compose / "redis" / "users.acl", redis_acl_file(users))
    # The Redis container reads the file as its own user.
    (compose / "redis" / "users.acl").chmod(0o644)
    print(f"wrote {env_path} and {compose / 'redis' / 'users.acl'}")  # noqa: T201
    return 0


if __name__ == "__main__":
    default = Path(__file__).resolve().parent.parent / "compose"
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
