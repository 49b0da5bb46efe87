"""The chaos drill's count: what the clients saw, set against what the topics hold.

Accepted is what an ingress stored on a request topic (read there, to the end offsets).
Each accepted request is answered or explicitly failed as its client saw it; one whose
client connection died with its ingress counts by its usage event's outcome; anything
else is lost. Batch lines must have one result each, and every accepted request a usage
event. A re-run after a crash may send a second event for a request (reported); what must
hold is that the accounting counts each request once: the streams app's hourly rollups (read
from their changelog topic) must count, per class, exactly the request ids with an event.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import orjson
from aiokafka import AIOKafkaConsumer

from laneway.batch import batch_request_id
from laneway.errors import MalformedMessage, ServiceError
from laneway.schema import BatchRequest, RequestEnvelope, decode
from ops.drills.chaos_clients import Attempt, ClientRequest, tag_of

__all__ = ["Accepted", "ChaosTally", "TopicRecord", "read_to_end", "tally"]

TopicRecord = tuple[str, bytes]  # topic, value
_W = TypeVar("_W", RequestEnvelope, BatchRequest)


@dataclass(frozen=True)
class Accepted:
    """A request an ingress stored on a request topic."""

    id: str
    tag: str | None
    cls: str


@dataclass
class ChaosTally:
    """The drill's numbers; ``lost``, ``batch_missing`` and the usage lists name ids."""

    accepted: Counter[str] = field(default_factory=Counter)  # by class
    answered: int = 0
    answered_after_ingress_died: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # by what the client saw
    lost: list[str] = field(default_factory=list)
    batch_lines: int = 0
    batch_results: int = 0
    batch_duplicates: int = 0
    batch_missing: list[str] = field(default_factory=list)
    usage_events: int = 0
    usage_missing: list[str] = field(default_factory=list)
    usage_twice: list[str] = field(default_factory=list)  # ids with more than one event
    usage_extra: int = 0  # events beyond one per id
    usage_conflicting: list[str] = field(default_factory=list)  # two different outcomes
    # Answered requests whose usage event (the first, the one the rollups count) is not ok:
    # billed as a drop, not the tokens their clients got.
    usage_not_ok: list[str] = field(default_factory=list)
    # Per class: request ids with a usage event, and requests the streams app counted.
    usage_ids: Counter[str] = field(default_factory=Counter)
    usage_counted: Counter[str] | None = None  # None: not read
    # Batch tokens the usage events say the lines used (each line once), and what the
    # quota charged the teams' batch pools in Redis (None: not read).
    batch_tokens_used: dict[str, int] = field(default_factory=dict)  # by team
    batch_tokens_charged: dict[str, int] | None = None
    clients_sent: int = 0
    clients_retried: int = 0
    clients_without_answer: int = 0
    # What the clients never answered saw last: an HTTP status and error code, or the
    # transport's failure (a refusal before acceptance, a shed, an ingress killed under it).
    unanswered: Counter[str] = field(default_factory=Counter)

    @property
    def usage_counted_twice(self) -> int:
        """Requests the rollups counted beyond one per request id."""
        counted = self.usage_counted or Counter()
        return sum(max(0, counted[c] - self.usage_ids[c]) for c in counted)

    @property
    def usage_uncounted(self) -> int:
        """Request ids with a usage event that the rollups do not count (all, if unread)."""
        counted = self.usage_counted or Counter()
        return sum(max(0, n - counted[c]) for c, n in self.usage_ids.items())

    @property
    def target_met(self) -> bool:
        """0 lost, 0 duplicated, 0 usage missing or counted other than once."""
        return not (
            self.lost
            or self.batch_missing
            or self.batch_duplicates
            or self.usage_missing
            or self.usage_not_ok
            or self.usage_counted_twice
            or self.usage_uncounted
            or self.batch_charge_off
        )

    @property
    def batch_charge_off(self) -> int:
        """Batch tokens charged other than used, summed over the teams (each team's
        difference counted whole, so one team's excess cannot hide another's shortfall);
        0 unread."""
        if self.batch_tokens_charged is None:
            return 0
        teams = set(self.batch_tokens_charged) | set(self.batch_tokens_used)
        return sum(
            abs(self.batch_tokens_charged.get(t, 0) - self.batch_tokens_used.get(t, 0))
            for t in teams
        )


async def read_to_end(
    bootstrap: str, topics: Sequence[str], *, within_s: float = 60.0
) -> list[TopicRecord]:
    """Every record the topics hold now, up to the end offsets the brokers report at the
    start, read committed (an aborted transaction's records are not there)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await consumer.start()  # no group: every partition of the topics
    found: list[TopicRecord] = []
    try:
        ends = await consumer.end_offsets(list(consumer.assignment()))
        deadline = time.monotonic() + within_s
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            if time.monotonic() > deadline:
                raise ServiceError(f"{', '.join(topics)}: not read to the end in {within_s:.0f}s")
            batches = await consumer.getmany(timeout_ms=500)
            found.extend((r.topic, r.value) for rs in batches.values() for r in rs)
    finally:
        await consumer.stop()
    return found


def _decoded(records: Sequence[TopicRecord], model: type[_W]) -> Iterator[_W]:
    """The records that are ``model``s (another writer's are skipped)."""
    for _, value in records:
        try:
            item = decode(model, value)
        except MalformedMessage:
            continue
        yield item


def accepted_requests(records: Sequence[TopicRecord]) -> list[Accepted]:
    """The interactive requests on the request topics, with the client tag they carry."""
    return [
        Accepted(
            env.id, tag_of(env.prompt + "".join(m.content for m in env.messages or [])), env.cls
        )
        for env in _decoded(records, RequestEnvelope)
    ]


def batch_lines(records: Sequence[TopicRecord], jobs: Collection[str]) -> list[str]:
    """Request ids of the lines of ``jobs`` on the batch request topic."""
    return [
        batch_request_id(line.job_id, line.line_id)
        for line in _decoded(records, BatchRequest)
        if line.job_id in jobs
    ]


def batch_results(records: Sequence[TopicRecord], jobs: Collection[str]) -> list[str]:
    """Request ids of the result records of ``jobs`` (a line twice: a duplicate)."""
    found = []
    for _, value in records:
        item = orjson.loads(value)
        if item.get("type") == "result" and item.get("job_id") in jobs:
            found.append(batch_request_id(str(item["job_id"]), str(item["line_id"])))
    return found


def usage_outcomes(records: Sequence[TopicRecord]) -> dict[str, list[str]]:
    """Request id → the status of each of its usage events."""
    found: dict[str, list[str]] = defaultdict(list)
    for _, value in records:
        item = orjson.loads(value)
        found[str(item.get("id"))].append(str(item.get("status")))
    return found


def ids_with_usage(records: Sequence[TopicRecord], teams: Collection[str]) -> Counter[str]:
    """Per class: the request ids of ``teams`` with at least one usage event."""
    classes = {}
    for _, value in records:
        item = orjson.loads(value)
        if item.get("team") in teams:
            classes[(str(item["team"]), str(item.get("id")))] = str(item.get("class"))
    return Counter(classes.values())


def batch_tokens_used(
    records: Sequence[TopicRecord], teams: Collection[str], min_charge: int
) -> dict[str, int]:
    """Per team: the tokens the batch lines of ``teams`` used, as their usage events say (a line's
    re-run counted once; one that used none, ``min_charge``, as the quota charges it): what
    the quota must have charged their batch pools."""
    used: dict[tuple[str, str], int] = {}
    for _, value in records:
        item = orjson.loads(value)
        if item.get("team") in teams and item.get("class") == "batch":
            tokens = int(item.get("prompt_tokens", 0)) + int(item.get("completion_tokens", 0))
            used.setdefault((str(item["team"]), str(item.get("id"))), tokens or min_charge)
    per_team = dict.fromkeys(teams, 0)
    for (team, _), tokens in used.items():
        per_team[team] += tokens
    return per_team


def rollup_requests(records: Sequence[TopicRecord], teams: Collection[str]) -> Counter[str]:
    """Per class: the requests of ``teams`` the streams app's hourly rollups count, from the
    rollups table's changelog (the last value of each team/class/model/hour wins)."""
    latest: dict[tuple[str, str, str, int], int] = {}
    for _, value in records:
        item = orjson.loads(value) if value else None
        if isinstance(item, dict) and item.get("team") in teams and "requests" in item:
            key = (str(item["team"]), str(item["class"]), str(item["model"]), int(item["hour"]))
            latest[key] = int(item["requests"])
    counted: Counter[str] = Counter()
    for (_, cls, _, _), requests in latest.items():
        counted[cls] += requests
    return counted


def tally(
    requests: Sequence[ClientRequest],
    ingress_killed: Mapping[int, float],
    accepted: Sequence[Accepted],
    usage: Mapping[str, list[str]],
    *,
    lines: Sequence[str] = (),
    results: Sequence[str] = (),
    with_usage: Counter[str] | None = None,
    rollups: Counter[str] | None = None,
    batch_tokens: dict[str, int] | None = None,
) -> ChaosTally:
    """Set the clients' records against the topics' (pure: what the unit tests check).
    ``lines`` and ``results``: the request ids of the batch lines on the request topic and
    of the result records (``batch_lines``, ``batch_results``)."""
    out = ChaosTally()
    by_tag = {r.tag: r for r in requests}
    by_id = {a.request_id: a for r in requests for a in r.attempts if a.request_id}
    for item in accepted:
        out.accepted[item.cls] += 1
        attempt = by_id.get(item.id) or _blind_attempt(by_tag.get(item.tag or ""))
        _judge(out, item, attempt, ingress_killed=ingress_killed, usage=usage)
    out.clients_sent = len(requests)
    out.clients_retried = sum(len(r.attempts) > 1 for r in requests)
    never = [r for r in requests if not any(a.outcome == "answered" for a in r.attempts)]
    out.clients_without_answer = len(never)
    out.unanswered = Counter(_last_seen(r) for r in never)
    out.batch_lines = len(lines)
    per_line = Counter(results)
    out.batch_results = len(results)
    out.batch_duplicates = sum(n - 1 for n in per_line.values() if n > 1)
    out.batch_missing = [line for line in lines if line not in per_line]
    out.accepted["batch"] += len(lines)
    ids = [a.id for a in accepted] + list(lines)
    out.usage_events = sum(len(v) for v in usage.values())
    out.usage_missing = [i for i in ids if not usage.get(i)]
    for rid in ids:
        statuses = usage.get(rid, [])
        if len(statuses) > 1:
            out.usage_twice.append(rid)
            out.usage_extra += len(statuses) - 1
            if len(set(statuses)) > 1:
                out.usage_conflicting.append(f"{rid}: {', '.join(statuses)}")
    out.usage_ids = with_usage or Counter()
    out.usage_counted = rollups
    out.batch_tokens_used = dict(batch_tokens or {})
    return out


def _last_seen(request: ClientRequest) -> str:
    if not request.attempts:
        return "no replica up"
    last = request.attempts[-1]
    if last.outcome == "failed":
        return f"{last.status} {last.detail}".strip()
    return f"{last.outcome} {last.detail}".strip()


def _blind_attempt(request: ClientRequest | None) -> Attempt | None:
    """For an accepted request whose client never learnt its id (an error status carries
    none; a connection can break before the headers): the attempt that learnt no id."""
    if request is None:
        return None
    blind = [a for a in request.attempts if a.request_id is None]
    failed = [a for a in blind if a.outcome == "failed"]
    return failed[0] if failed else next(iter(blind), None)


def _judge(
    out: ChaosTally,
    item: Accepted,
    attempt: Attempt | None,
    *,
    ingress_killed: Mapping[int, float],
    usage: Mapping[str, list[str]],
) -> None:
    """Answered, failed or lost: one accepted request."""
    if attempt is None:
        out.lost.append(f"{item.id} ({item.tag or 'no tag'}): no client attempt knows it")
        return
    if attempt.outcome == "answered":
        out.answered += 1
        statuses = usage.get(item.id, [])
        if statuses and statuses[0] != "ok":
            out.usage_not_ok.append(f"{item.id} ({item.tag}): answered, billed {statuses[0]}")
        return
    if attempt.outcome == "failed":
        out.failed[f"{attempt.status} {attempt.detail}".strip()] += 1
        return
    killed = ingress_killed.get(attempt.ingress)
    if attempt.outcome == "transport" and killed is not None and attempt.ended >= killed:
        statuses = usage.get(item.id, [])
        if "ok" in statuses:
            out.answered_after_ingress_died += 1
        elif statuses:
            out.failed[f"ingress died; usage: {statuses[0]}"] += 1
        else:
            out.lost.append(f"{item.id} ({item.tag}): its ingress died and no usage event")
        return
    out.lost.append(
        f"{item.id} ({item.tag}): client saw {attempt.outcome} {attempt.detail} "
        f"at +{attempt.ended:.1f}s on ingress-{attempt.ingress + 1}"
    )
