"""``laneway batch``: submit, follow and fetch batch jobs.

By default through the ingress's OpenAI Files and Batches API with the team's key (all a
tenant holds); ``--kafka`` straight to the batch topics, for service principals whose Kafka
ACLs allow it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from laneway.arguments import positive_float
from laneway.batch import MAX_JOB_ID_CHARS, BatchClient, output_line
from laneway.batch_http import HttpBatchClient
from laneway.errors import BadRequest, ConfigError, LanewayError
from laneway.settings import CommonSettings, load_settings

__all__ = ["add_batch_commands"]


def _api_key(args: argparse.Namespace) -> str:
    key: str | None = args.key or os.environ.get("LANEWAY_API_KEY")
    if not key:
        raise ConfigError("an API key is needed: --key KEY or LANEWAY_API_KEY")
    return key


def _endpoint_of(lines: list[str]) -> str:
    """The url of the file's first line that names one (a batch has one endpoint)."""
    for text in lines:
        try:
            url = orjson.loads(text).get("url")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if url in ("/v1/chat/completions", "/v1/completions"):
            return str(url)
    return "/v1/chat/completions"


def _jsonl_lines(path: Path) -> list[str]:
    """The lines of a JSONL file: UTF-8, split at ``\n`` alone (U+2028, form feeds and the
    like are text inside a JSON string, which ``str.splitlines`` would cut at)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: name a JSONL file")
    if not path.exists():
        raise ConfigError(f"no such file: {path}")
    try:
        return path.read_bytes().decode("utf-8").split("\n")
    except OSError as exc:  # not readable by this user, a broken disk
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"{path} is not UTF-8 text (byte {exc.start}): a batch file is JSON lines"
        ) from None


def cmd_batch_submit(args: argparse.Namespace) -> int:
    path = Path(args.file)
    lines = _jsonl_lines(path)
    settings = load_settings(CommonSettings)
    if args.kafka:
        return _submit_to_kafka(args, path, lines, settings)

    async def submit() -> int:
        endpoint = args.endpoint or _endpoint_of(lines)
        async with HttpBatchClient(settings.ingress_url, _api_key(args)) as client:
            batch = await client.submit(path, endpoint, {"source": path.name[:500]})
            print(f"submitted job {batch['id']}")
            if args.wait:
                await _follow(client, batch["id"], args.timeout)
        print(batch["id"])
        return 0

    return asyncio.run(submit())


async def _follow(client: HttpBatchClient, batch_id: str, give_up_s: float) -> None:
    deadline = time.monotonic() + give_up_s
    batch = await client.batch(batch_id)
    with tqdm(total=batch["request_counts"]["total"] or None, unit="line", desc="running") as bar:
        while True:
            counts = batch["request_counts"]
            bar.total = counts["total"] or bar.total
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            if client.finished(batch):
                break
            if time.monotonic() > deadline:
                raise LanewayError(
                    f"job {batch_id} not done after {give_up_s:.0f}s ({batch['status']}, "
                    f"{counts['completed'] + counts['failed']}/{counts['total']})"
                )
            await asyncio.sleep(1.0)
            batch = await client.batch(batch_id)
    counts = batch["request_counts"]
    print(
        f"job {batch_id}: {batch['status']}, {counts['completed']} ok, "
        f"{counts['failed']} failed of {counts['total']}"
    )
    if batch["status"] == "failed":
        errors = (batch.get("errors") or {}).get("data") or []
        raise BadRequest("; ".join(e.get("message", "") for e in errors) or "batch failed")


def _submit_to_kafka(
    args: argparse.Namespace, path: Path, lines: list[str], settings: CommonSettings
) -> int:
    """``--kafka``: straight onto laneway.req.batch, for a service principal whose Kafka
    ACL lets it write the team's batch work."""
    if not args.team:
        raise ConfigError("--kafka writes lines for a team: name it with --team T")
    if args.job_id is not None and not 1 <= len(args.job_id) <= MAX_JOB_ID_CHARS:
        raise ConfigError(
            f"--job-id has {len(args.job_id)} characters: a job id has 1 to {MAX_JOB_ID_CHARS}"
        )

    async def submit() -> int:
        async with BatchClient(settings) as client:
            with tqdm(
                total=sum(1 for x in lines if x.strip()), unit="line", desc="submitting"
            ) as bar:
                job = await client.submit(
                    lines,
                    team=args.team,
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

    async def from_kafka() -> int:
        async with BatchClient(settings) as client:
            st = await client.status(args.job)
        state = "complete" if st.complete else "running"
        print(f"job {st.job_id} (team {st.team}): {state}, {st.done}/{st.lines} done,", end=" ")
        print(f"{st.ok} ok, {st.failed} failed")
        return 0

    async def over_http() -> int:
        async with HttpBatchClient(settings.ingress_url, _api_key(args)) as client:
            batch = await client.batch(args.job)
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        print(
            f"job {batch['id']}: {batch['status']}, {done}/{counts['total']} done, "
            f"{counts['completed']} ok, {counts['failed']} failed"
        )
        return 0

    return asyncio.run(from_kafka() if args.kafka else over_http())


def cmd_batch_results(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    if args.output != "-":
        _writable(Path(args.output))  # before the results are fetched, not after

    async def from_kafka() -> bytes:
        async with BatchClient(settings) as client:
            found = await client.results(args.job)
        return b"".join(orjson.dumps(output_line(r)) + b"\n" for r in found)

    async def over_http() -> bytes:
        async with HttpBatchClient(settings.ingress_url, _api_key(args)) as client:
            return await client.results(args.job)

    text = asyncio.run(from_kafka() if args.kafka else over_http())
    if args.output == "-":
        sys.stdout.write(text.decode())
    else:
        try:
            Path(args.output).write_bytes(text)
        except OSError as exc:
            raise ConfigError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {len(text.splitlines())} results to {args.output}")
    return 0


def _writable(path: Path) -> None:
    """Refuse an output path that cannot be a file written by this user."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: name the file to write")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {path}: no directory {folder}")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"cannot write {path}: permission denied")


def add_batch_commands(sub: Any) -> None:
    """The ``batch`` command and its subcommands."""
    batch = sub.add_parser("batch", help="batch jobs (OpenAI Batch format)").add_subparsers(
        dest="batch_command", required=True
    )
    kafka_help = (
        "straight to/from Kafka instead of the ingress's Batches API: for service "
        "principals whose Kafka ACLs allow it (tenants use the API with their key)"
    )
    bsubmit = batch.add_parser("submit", help="submit a JSONL file of OpenAI Batch input lines")
    bsubmit.add_argument("file")
    bsubmit.add_argument("--key", help="the team's API key (or LANEWAY_API_KEY)")
    bsubmit.add_argument(
        "--endpoint",
        choices=["/v1/chat/completions", "/v1/completions"],
        default=None,
        help="the batch's endpoint (default: the url of the file's first line)",
    )
    bsubmit.add_argument("--wait", action="store_true", help="follow the job until it is done")
    bsubmit.add_argument(
        "--timeout", type=positive_float, default=24 * 3600, help="--wait: give up after (s)"
    )
    bsubmit.add_argument("--kafka", action="store_true", help=kafka_help)
    bsubmit.add_argument("--team", default=None, help="--kafka: the team the lines run for")
    bsubmit.add_argument("--job-id", default=None, help="--kafka: the job id (default: new)")
    bsubmit.set_defaults(func=cmd_batch_submit)
    bstatus = batch.add_parser("status", help="lines done, ok and failed")
    bstatus.add_argument("job")
    bstatus.add_argument("--key", help="the team's API key (or LANEWAY_API_KEY)")
    bstatus.add_argument("--kafka", action="store_true", help=kafka_help)
    bstatus.set_defaults(func=cmd_batch_status)
    bresults = batch.add_parser("results", help="write the OpenAI Batch output lines")
    bresults.add_argument("job")
    bresults.add_argument("-o", "--output", default="-", help="file (default: stdout)")
    bresults.add_argument("--key", help="the team's API key (or LANEWAY_API_KEY)")
    bresults.add_argument("--kafka", action="store_true", help=kafka_help)
    bresults.set_defaults(func=cmd_batch_results)
