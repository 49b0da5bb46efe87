"""The ``laneway`` command line: run the stack, manage keys and teams."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.apikeys import create_key, hash_key, key_id, list_keys, revoke_key
from laneway.arguments import finite_float, int_from
from laneway.clients import kafka_auth, make_producer
from laneway.errors import BadRequest, ConfigError, LanewayError, ServiceError
from laneway.logs import setup_logging
from laneway.settings import CommonSettings, load_settings
from ops.batch_cli import add_batch_commands
from ops.canary_cli import add_canary_commands
from ops.drills import add_drill_commands
from ops.kafka_topics import create_topics
from ops.local_stack import run_local_stack
from ops.principals_cli import add_principal_commands
from ops.settings import StackSettings
from ops.shadow_cli import add_shadow_commands
from ops.with_redis import with_redis
from quota.teams import Team, get_team, set_team
from streams.report import add_report_commands
from streams.usage_tail import add_usage_commands

__all__ = ["main"]


def cmd_keys_create(args: argparse.Namespace) -> int:
    async def create(settings: CommonSettings, redis: aioredis.Redis) -> int:
        key = await create_key(redis, settings.keys, args.team)
        print(f"created API key {key_id(hash_key(key))} for team {args.team!r}; it is shown once:")
        print(key)
        return 0

    return with_redis(create)


def cmd_keys_list(args: argparse.Namespace) -> int:
    async def show(settings: CommonSettings, redis: aioredis.Redis) -> int:
        records = await list_keys(redis, settings.keys, args.team)
        for record in records:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            print(f"{record.id}  {record.team}  created {created}")
        if not records:
            who = f" of team {args.team!r}" if args.team else ""
            print(f"no API keys{who}", file=sys.stderr)
        return 0

    return with_redis(show)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    if not args.key.strip():
        raise BadRequest("name the key to revoke: the key itself or its id (laneway keys list)")

    async def revoke(settings: CommonSettings, redis: aioredis.Redis) -> int:
        producer = make_producer(settings)
        try:
            await producer.start()
            record = await revoke_key(redis, producer, settings.topics, settings.keys, args.key)
        except KafkaError as exc:
            raise ServiceError(
                f"Kafka did not store the revocation ({exc}): the key is NOT revoked; retry"
            ) from exc
        finally:
            await producer.stop()
        print(f"revoked API key {record.id} of team {record.team or '(unknown)'!r}")
        return 0

    return with_redis(revoke)


# The options of ``teams set``, each a field of ``quota.Team`` of the same name.
_TEAM_FIELDS = ("size", "complexity", "tier", "supersede_grace_tokens", "type_through")


def _describe(team: Team) -> str:
    return (
        f"team {team.name}: size {team.size}, complexity {team.complexity}, "
        f"tier {team.tier}, supersede grace {team.supersede_grace_tokens} tokens, "
        f"type-through {'on' if team.type_through else 'off'}"
    )


def cmd_teams_set(args: argparse.Namespace) -> int:
    """Change the fields given; a field left out keeps its stored value (a new team needs
    ``--size``, and takes the defaults for the rest)."""
    given = {name: getattr(args, name) for name in _TEAM_FIELDS if getattr(args, name) is not None}

    async def store(settings: CommonSettings, redis: aioredis.Redis) -> int:
        if await redis.sismember(settings.keys.teams(), args.team):
            team = replace(await get_team(redis, settings.keys, args.team), **given)
        elif "size" not in given:
            raise BadRequest(
                f"team {args.team!r} does not exist yet: give its --size to create it",
                param="size",
            )
        else:
            team = Team(args.team, **given)
        await set_team(redis, settings.keys, team)
        print(_describe(team))
        return 0

    return with_redis(store)


def cmd_teams_show(args: argparse.Namespace) -> int:
    async def show(settings: CommonSettings, redis: aioredis.Redis) -> int:
        if not await redis.sismember(settings.keys.teams(), args.team):
            raise BadRequest(
                f"no team {args.team!r} (create it with: laneway teams set {args.team} --size N)",
                param="team",
            )
        print(_describe(await get_team(redis, settings.keys, args.team)))
        return 0

    return with_redis(show)


def cmd_topics_create(args: argparse.Namespace) -> int:
    settings = load_settings(StackSettings)
    replicas = args.replication_factor or settings.replication_factor
    if not 1 <= replicas <= 7:
        raise ConfigError(f"--replication-factor must be within 1..7, not {replicas}")
    if args.partitions < 0:
        raise ConfigError(f"--partitions must be at least 1, not {args.partitions}")
    specs = settings.topics.specs(args.partitions or settings.partitions)
    create_topics(settings.kafka_bootstrap, specs, replicas, kafka_auth(settings))
    for name, partitions, _ in specs:
        print(f"{name} ({partitions} partitions, {replicas} replicas)")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Run Redis, Kafka, the ingress, a worker per pool and the streams app, supervised."""
    run_local_stack(load_settings(StackSettings))
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
    klist = keys.add_parser("list", help="ids, teams and creation times of the keys (never a key)")
    klist.add_argument("--team", default=None, help="only this team's keys")
    klist.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser(
        "revoke", help="revoke a key: every ingress refuses it within seconds, Redis or not"
    )
    revoke.add_argument("key", metavar="KEY_OR_ID", help="the key's id (key-…) or the key")
    revoke.set_defaults(func=cmd_keys_revoke)

    teams = sub.add_parser("teams", help="team records").add_subparsers(
        dest="teams_command", required=True
    )
    tset = teams.add_parser(
        "set",
        help="create a team, or change the fields given of its size, complexity factor, tier "
        "and supersession and type-through policies (the others keep their values)",
    )
    tset.add_argument("team")
    tset.add_argument("--size", type=int, help="required for a new team")
    tset.add_argument("--complexity", type=finite_float, help="new team: 1.0")
    tset.add_argument("--tier", choices=["hi", "lo"], help="new team: hi")
    tset.add_argument(
        "--supersede-grace-tokens",
        type=int,
        metavar="N",
        help="a superseded completion that already streamed N tokens may finish "
        "(new team: 0, dropped at once)",
    )
    tset.add_argument(
        "--type-through",
        action=argparse.BooleanOptionalAction,
        help="serve a keystroke that types a running or recent suggestion from it (new team: on)",
    )
    tset.set_defaults(func=cmd_teams_set)
    tshow = teams.add_parser("show", help="a team's record")
    tshow.add_argument("team")
    tshow.set_defaults(func=cmd_teams_show)

    add_batch_commands(sub)

    topics = sub.add_parser("topics", help="Kafka topics").add_subparsers(
        dest="topics_command", required=True
    )
    tcreate = topics.add_parser("create", help="create the topics of DESIGN.md that are missing")
    tcreate.add_argument(
        "--partitions", type=int_from(0, 256), default=0, help="default: LANEWAY_PARTITIONS"
    )
    tcreate.add_argument(
        "--replication-factor",
        type=int,
        default=0,
        metavar="N",
        help="replicas of each topic (default: LANEWAY_REPLICATION_FACTOR; at most the brokers)",
    )
    tcreate.set_defaults(func=cmd_topics_create)
    add_usage_commands(sub)
    add_report_commands(sub)
    add_drill_commands(sub)
    add_canary_commands(sub)
    add_shadow_commands(sub)
    add_principal_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging("WARNING")
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C: what the command did so far stands (a submitted job runs on); no traceback.
        print("laneway: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, BadRequest) as exc:
        print(f"laneway: {exc}", file=sys.stderr)
        return 2
    except LanewayError as exc:
        print(f"laneway: {exc}", file=sys.stderr)
        return 1
    except RedisError as exc:
        # Not the URL: it may hold a password.
        print(
            "laneway: Redis (LANEWAY_REDIS_URL, or unset the local stack's on "
            f"LANEWAY_REDIS_PORT) did not answer: {exc}",
            file=sys.stderr,
        )
        return 1
    except KafkaError as exc:
        print(f"laneway: Kafka at {_bootstrap()} did not answer: {exc!r}", file=sys.stderr)
        return 1
    return result


def _bootstrap() -> str:
    """Where the CLI looked for Kafka (LANEWAY_KAFKA_BOOTSTRAP, or its default)."""
    try:
        return load_settings(CommonSettings).kafka_bootstrap
    except ConfigError:
        return "LANEWAY_KAFKA_BOOTSTRAP"


if __name__ == "__main__":
    sys.exit(main())
