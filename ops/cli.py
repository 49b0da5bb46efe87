"""The ``laneway`` command line: run the stack, manage keys and teams."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from tqdm import tqdm

from laneway.apikeys import create_key, hash_key, key_id, list_keys, revoke_key
from laneway.batch import BatchClient, output_line
from laneway.clients import kafka_auth, make_producer, make_redis
from laneway.errors import BadRequest, ConfigError, LanewayError, ServiceError
from laneway.logs import setup_logging
from laneway.schema import BatchResult
from laneway.settings import CommonSettings, load_settings
from ops.canary_cli import add_canary_commands
from ops.devstack import create_topics
from ops.drills import add_drill_commands
from ops.local_stack import run_local_stack
from ops.principals_cli import add_principal_commands
from ops.settings import StackSettings
from quota.teams import Team, set_team
from streams.report import add_report_commands
from streams.usage_tail import add_usage_commands

__all__ = ["main"]


def _run_redis(command: Callable[[CommonSettings], Awaitable[int]]) -> int:
    settings = load_settings(CommonSettings)

    async def run() -> int:
        return await command(settings)

    return asyncio.run(run())


def _with_redis(work: Callable[[CommonSettings, aioredis.Redis], Awaitable[int]]) -> int:
    """Run ``work`` with the settings and a Redis client that is closed after it."""

    async def run(settings: CommonSettings) -> int:
        redis = make_redis(settings)
        try:
            return await work(settings, redis)
        finally:
            await redis.aclose()

    return _run_redis(run)


def cmd_keys_create(args: argparse.Namespace) -> int:
    async def create(settings: CommonSettings, redis: aioredis.Redis) -> int:
        key = await create_key(redis, settings.keys, args.team)
        print(f"created API key {key_id(hash_key(key))} for team {args.team!r}; it is shown once:")
        print(key)
        return 0

    return _with_redis(create)


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

    return _with_redis(show)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
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

    return _with_redis(revoke)


def cmd_teams_set(args: argparse.Namespace) -> int:
    team = Team(
        args.team,
        size=args.size,
        complexity=args.complexity,
        tier=args.tier,
        supersede_grace_tokens=args.supersede_grace_tokens,
        type_through=args.type_through,
    )

    async def store(settings: CommonSettings) -> int:
        redis = make_redis(settings)
        try:
            await set_team(redis, settings.keys, team)
        finally:
            await redis.aclose()
        print(
            f"team {team.name}: size {team.size}, complexity {team.complexity}, "
            f"tier {team.tier}, supersede grace {team.supersede_grace_tokens} tokens, "
            f"type-through {'on' if team.type_through else 'off'}"
        )
        return 0

    return _run_redis(store)


def _api_key(args: argparse.Namespace) -> str:
    key: str | None = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    return key


def cmd_batch_submit(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    lines = path.read_text().splitlines()
    settings = load_settings(CommonSettings)

    async def submit() -> int:
        async with BatchClient(settings) as client:
            with tqdm(
                total=sum(1 for x in lines if x.strip()), unit="line", desc="submitting"
            ) as bar:
                job = await client.submit(
                    lines,
                    api_key=_api_key(args),
                    job_id=args.job_id,
                    source=path.name,
                    progress=bar.update,
                )
            print(f"submitted job {job}")
            if args.wait:
                await _wait_for(client, job, args.timeout)
        print(job)
        return 0

    return asyncio.run(submit())


async def _wait_for(client: BatchClient, job: str, give_up_s: float) -> None:
    deadline = time.monotonic() + give_up_s
    status = await client.status(job)
    with tqdm(total=status.lines, unit="line", desc="running") as bar:
        while True:
            bar.update(status.done - bar.n)
            if status.complete:
                break
            if time.monotonic() > deadline:
                raise LanewayError(
                    f"job {job} not done after {give_up_s:.0f}s ({status.done}/{status.lines})"
                )
            await asyncio.sleep(1.0)
            status = await client.status(job)
    print(f"job {job}: {status.ok} ok, {status.failed} failed of {status.lines}")


def cmd_batch_status(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)

    async def status() -> int:
        async with BatchClient(settings) as client:
            st = await client.status(args.job)
        state = "complete" if st.complete else "running"
        print(f"job {st.job_id} (team {st.team}): {state}, {st.done}/{st.lines} done,", end=" ")
        print(f"{st.ok} ok, {st.failed} failed")
        return 0

    return asyncio.run(status())


def cmd_batch_results(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)

    async def results() -> list[BatchResult]:
        async with BatchClient(settings) as client:
            return await client.results(args.job)

    found = asyncio.run(results())
    text = "".join(orjson.dumps(output_line(r)).decode() + "\n" for r in found)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {len(found)} results to {args.output}")
    return 0


def cmd_topics_create(args: argparse.Namespace) -> int:
    settings = load_settings(StackSettings)
    specs = settings.topics.specs(args.partitions or settings.partitions)
    create_topics(
        settings.kafka_bootstrap, specs, settings.replication_factor, kafka_auth(settings)
    )
    for name, partitions, _ in specs:
        print(f"{name} ({partitions} partitions)")
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
        "set", help="set a team's size, complexity factor, tier and supersession policy"
    )
    tset.add_argument("team")
    tset.add_argument("--size", type=int, required=True)
    tset.add_argument("--complexity", type=float, default=1.0)
    tset.add_argument("--tier", choices=["hi", "lo"], default="hi")
    tset.add_argument(
        "--supersede-grace-tokens",
        type=int,
        default=0,
        metavar="N",
        help="a superseded completion that already streamed N tokens may finish "
        "(default 0: dropped at once)",
    )
    tset.add_argument(
        "--type-through",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve a keystroke that types a running or recent suggestion from it (default: on)",
    )
    tset.set_defaults(func=cmd_teams_set)

    batch = sub.add_parser("batch", help="batch jobs (OpenAI Batch format)").add_subparsers(
        dest="batch_command", required=True
    )
    bsubmit = batch.add_parser("submit", help="submit a JSONL file of OpenAI Batch input lines")
    bsubmit.add_argument("file")
    bsubmit.add_argument("--key", help="the team's API key (or LANEWAY_API_KEY)")
    bsubmit.add_argument("--job-id", default=None, help="default: a new id")
    bsubmit.add_argument("--wait", action="store_true", help="follow the job until it is done")
    bsubmit.add_argument("--timeout", type=float, default=24 * 3600, help="--wait: give up after")
    bsubmit.set_defaults(func=cmd_batch_submit)
    bstatus = batch.add_parser("status", help="lines done, ok and failed")
    bstatus.add_argument("job")
    bstatus.set_defaults(func=cmd_batch_status)
    bresults = batch.add_parser("results", help="write the OpenAI Batch output lines")
    bresults.add_argument("job")
    bresults.add_argument("-o", "--output", default="-", help="file (default: stdout)")
    bresults.set_defaults(func=cmd_batch_results)

    topics = sub.add_parser("topics", help="Kafka topics").add_subparsers(
        dest="topics_command", required=True
    )
    tcreate = topics.add_parser("create", help="create the topics of DESIGN.md that are missing")
    tcreate.add_argument("--partitions", type=int, default=0)
    tcreate.set_defaults(func=cmd_topics_create)
    add_usage_commands(sub)
    add_report_commands(sub)
    add_drill_commands(sub)
    add_canary_commands(sub)
    add_principal_commands(sub)
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
