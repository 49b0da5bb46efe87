"""The ``laneway`` command line: run the stack, manage keys and teams."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from laneway.apikeys import create_key
from laneway.clients import make_redis
from laneway.devstack import KafkaBroker, RedisServer, create_topics
from laneway.errors import BadRequest, ConfigError, LanewayError
from laneway.logs import setup_logging
from laneway.settings import CommonSettings, StackSettings, load_settings
from quota.teams import Team, set_team

__all__ = ["main"]

log = logging.getLogger("laneway")


def _run_redis(command: Callable[[CommonSettings], Awaitable[int]]) -> int:
    settings = load_settings(CommonSettings)

    async def run() -> int:
        return await command(settings)

    return asyncio.run(run())


def cmd_keys_create(args: argparse.Namespace) -> int:
    async def create(settings: CommonSettings) -> int:
        redis = make_redis(settings)
        try:
            key = await create_key(redis, settings.keys, args.team)
        finally:
            await redis.aclose()
        print(f"created an API key for team {args.team!r}; it is shown once:")
        print(key)
        return 0

    return _run_redis(create)


def cmd_teams_set(args: argparse.Namespace) -> int:
    team = Team(args.team, size=args.size, complexity=args.complexity, tier=args.tier)

    async def store(settings: CommonSettings) -> int:
        redis = make_redis(settings)
        try:
            await set_team(redis, settings.keys, team)
        finally:
            await redis.aclose()
        print(f"team {team.name}: size {team.size}, complexity {team.complexity}, tier {team.tier}")
        return 0

    return _run_redis(store)


def cmd_topics_create(args: argparse.Namespace) -> int:
    settings = load_settings(StackSettings)
    specs = settings.topics.specs(args.partitions or settings.partitions)
    create_topics(settings.kafka_bootstrap, specs)
    for name, partitions, _ in specs:
        print(f"{name} ({partitions} partitions)")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start Redis, Kafka, the ingress and one worker per pool; Ctrl-C stops them all."""
    settings = load_settings(StackSettings)
    data = Path(settings.data_dir).resolve()
    redis_server = RedisServer(port=settings.redis_port, data_dir=data / "redis")
    broker = KafkaBroker(
        port=settings.kafka_port,
        data_dir=data / "kafka",
        heap_mb=settings.kafka_heap_mb,
        partitions=settings.partitions,
    )
    children: list[subprocess.Popen[bytes]] = []
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"starting Redis on {redis_server.url}", flush=True)
        redis_server.start()
        print(f"starting Kafka (KRaft, single node) on {broker.bootstrap}", flush=True)
        broker.start()
        create_topics(broker.bootstrap, settings.topics.specs(settings.partitions))
        env = dict(os.environ)
        env.update(
            LANEWAY_KAFKA_BOOTSTRAP=broker.bootstrap,
            LANEWAY_REDIS_URL=redis_server.url,
        )
        for name in (
            "LANEWAY_KAFKA_PORT",
            "LANEWAY_REDIS_PORT",
            "LANEWAY_PARTITIONS",
            "LANEWAY_DATA_DIR",
            "LANEWAY_KAFKA_HEAP_MB",
        ):
            env.pop(name, None)
        ingress_env = dict(env, LANEWAY_PORT=str(settings.port))
        children.append(subprocess.Popen([sys.executable, "-m", "ingress"], env=ingress_env))
        for pool in ("completion", "chat", "batch"):
            worker_env = dict(env, LANEWAY_POOL=pool, LANEWAY_WORKER_ID=f"{pool}-1")
            worker_env.pop("LANEWAY_PORT", None)
            children.append(subprocess.Popen([sys.executable, "-m", "workers"], env=worker_env))
        print(
            f"laneway is up: OpenAI base URL http://127.0.0.1:{settings.port}/v1 "
            f"(create a key: .venv/bin/laneway keys create --team myteam). Ctrl-C stops.",
            flush=True,
        )
        while not stopping:
            for child in children:
                if child.poll() is not None:
                    raise LanewayError(
                        f"{child.args!r} exited with {child.returncode}; stopping the stack"
                    )
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping laneway...", flush=True)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
        broker.stop()
        redis_server.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laneway", description="laneway: traffic lanes for AI coding assistants"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run Kafka, Redis, ingress and workers in the foreground")
    up.set_defaults(func=cmd_up)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(
        dest="keys_command", required=True
    )
    create = keys.add_parser("create", help="create a key for a team (printed on the last line)")
    create.add_argument("--team", required=True)
    create.set_defaults(func=cmd_keys_create)

    teams = sub.add_parser("teams", help="team records").add_subparsers(
        dest="teams_command", required=True
    )
    tset = teams.add_parser("set", help="set a team's size, complexity factor and tier")
    tset.add_argument("team")
    tset.add_argument("--size", type=int, required=True)
    tset.add_argument("--complexity", type=float, default=1.0)
    tset.add_argument("--tier", choices=["hi", "lo"], default="hi")
    tset.set_defaults(func=cmd_teams_set)

    topics = sub.add_parser("topics", help="Kafka topics").add_subparsers(
        dest="topics_command", required=True
    )
    tcreate = topics.add_parser("create", help="create the topics of DESIGN.md that are missing")
    tcreate.add_argument("--partitions", type=int, default=0)
    tcreate.set_defaults(func=cmd_topics_create)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging("WARNING")
    try:
        result: int = args.func(args)
    except (ConfigError, BadRequest) as exc:
        print(f"laneway: {exc}", file=sys.stderr)
        return 2
    except LanewayError as exc:
        print(f"laneway: {exc}", file=sys.stderr)
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())
