"""A fetched record as a line of the batch lane (``BatchLane.accept``).

A record is decoded (one that is not a valid line but names its job and line is answered
with its problem), known by a request id scoped to its team's topic, and claimed by that id
until it is answered: a copy of a line still here is answered by it, another line of its id
at once with an error. A line then reserves its tokens, or is answered with why it cannot.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import TYPE_CHECKING, Any

import orjson
from aiokafka import ConsumerRecord, TopicPartition
from pydantic import ValidationError
from redis.exceptions import RedisError

from laneway.batch import MAX_CUSTOM_ID_CHARS
from laneway.errors import DuplicateLine, LanewayError, MalformedMessage
from laneway.json_shape import top_level_strings
from laneway.retry import Backoff
from laneway.schema import BatchRequest, BatchResult, RequestEnvelope, decode
from workers import metrics
from workers.batch import batch_request_id, error_result, result_records
from workers.batch_budget import RETRY_MAX_S
from workers.lanes import skip_record

if TYPE_CHECKING:
    from workers.batch_lane import BatchLane

__all__ = ["accept", "answer", "id_of", "let_go", "line_of", "release", "stored_at"]

log = logging.getLogger(__name__)


async def accept(
    lane: BatchLane, tp: TopicPartition, record: ConsumerRecord[Any, Any]
) -> RequestEnvelope | None:
    """``record`` as the envelope of its line, its tokens reserved; None when it is answered
    already (by the partition's last owner, or here at once) or names no line."""
    inherited = lane.inherited.get(tp)
    if inherited is not None and record.offset in inherited:
        return None  # answered by the partition's last owner, above its committed offset
    line = line_of(lane, tp, record)
    if line is None:
        return None
    request_id = id_of(lane, tp, line)
    digest = _line_digest(tp, line)
    holder = lane.holding.get(request_id)
    if holder is not None and holder[:2] != (tp, record.offset):
        if holder[2] == digest:
            # The same line again (its job sent twice): the one run answers both.
            log.info(
                "%s@%d: a copy of a line still here, answered by it", request_id, record.offset
            )
            metrics.BATCH_COPIES.labels(lane.worker.pool).inc()
            return None
        # Another line of the id: answered at once, the first's reservation untouched.
        answer(lane, tp, record.offset, line, _twice(request_id, holder))
        return None
    lane.holding[request_id] = (tp, record.offset, digest)  # before any wait: claimed
    accepted_at = stored_at(lane, record)  # once: its reservation is known by it
    backoff = Backoff(0.5, RETRY_MAX_S)
    while True:
        try:
            env = await lane.lines.envelope(line, request_id, accepted_at)
            await _fits(lane, env)
        except LanewayError as exc:
            result = answer(lane, tp, record.offset, line, exc)
            await release(lane, result.team, result.request_id, accepted_at)
            return None
        except (RedisError, OSError) as exc:
            # The key cannot be checked without Redis: the lane waits, nothing is dropped.
            log.warning("batch intake paused, Redis unreachable: %s", exc)
            await backoff.wait()
        else:
            return env


def line_of(
    lane: BatchLane,
    tp: TopicPartition,
    record: ConsumerRecord[Any, Any],
    *,
    read_back: bool = False,
) -> BatchRequest | None:
    """The batch line ``record`` holds (one that is not valid carries its problem as its
    error); None, skipped, for a record that names no job and line. ``read_back``: the
    record read again for a parked line, which was valid at intake; None, and nothing
    counted or logged, for one that is not valid (another record at its offset)."""
    try:
        line = decode(BatchRequest, record.value)
    except MalformedMessage as exc:
        if read_back:
            return None
        salvaged = _salvage(record.value, exc)
        if salvaged is None:  # it names no job and line: there is nowhere to answer it
            skip_record(lane.worker.pool, tp, record.offset, exc)
            return None
        # Answered with its error, as the line its submitter counts on.
        metrics.MALFORMED.labels(lane.worker.pool, tp.topic).inc()
        log.warning(
            "answering %s:%d@%d with an error: %s", tp.topic, tp.partition, record.offset, exc
        )
        line = salvaged
    # A team's own topic names the team (its ACL lets that team's principal alone write
    # it): whatever team or key the line names is not read.
    topic_team = lane.worker.topics.team_of_batch_topic(tp.topic)
    if topic_team is not None:
        line = line.model_copy(update={"team": topic_team, "api_key": None})
    return line


def id_of(lane: BatchLane, tp: TopicPartition, line: BatchRequest) -> str:
    """The request id of ``line``, read from ``tp``: scoped by the team of a team's own
    topic, so that two teams' lines never share one (each tenant chooses its job ids)."""
    topic_team = lane.worker.topics.team_of_batch_topic(tp.topic)
    return batch_request_id(line.job_id, line.line_id, topic_team)


def answer(
    lane: BatchLane, tp: TopicPartition, offset: int, line: BatchRequest, exc: LanewayError
) -> BatchResult:
    """``line`` is answered with ``exc`` as its result, written with its offset."""
    result = error_result(line, id_of(lane, tp, line), exc)
    lane.ledger.add(tp, offset, result_records(lane.worker.topics, result, None, tp.topic))
    let_go(lane, result.request_id, tp, offset)
    return result


def let_go(lane: BatchLane, request_id: str, tp: TopicPartition, offset: int) -> None:
    """The line at ``offset`` is answered: its id is free for another line."""
    holder = lane.holding.get(request_id)
    if holder is not None and holder[:2] == (tp, offset):
        del lane.holding[request_id]


async def release(lane: BatchLane, team: str, request_id: str, stored_at: float) -> None:
    """A line answered with an error may hold a reservation of an earlier run (taken at
    its intake, before a crash; its job cancelled since): it goes back whole, not held
    for a day. Only its own record's (``stored_at``): another record of its id, on
    another worker, keeps its reservation. Nothing to do for the others, and a Redis
    that does not answer leaves it to expire."""
    if lane.worker.quota is None or not team:
        return
    with contextlib.suppress(RedisError, OSError):
        await lane.worker.quota.settle(team, request_id, 0, min_charge=0, record=stored_at)


def stored_at(lane: BatchLane, record: ConsumerRecord[Any, Any]) -> float:
    """When the broker stored the line (its topics keep the broker's time): a line's
    acceptance, the same in every run of it. Now, for a record that carries no time."""
    return record.timestamp / 1000 if record.timestamp > 0 else lane.worker.clock.now()


async def _fits(lane: BatchLane, env: RequestEnvelope) -> None:
    """Reserve ``env``'s tokens once, as it comes in; raises ``QuotaExceeded`` for a line
    bigger than its team's whole batch budget, which becomes its result at once: waited
    for, it would never leave. A line the pool cannot cover yet is parked
    (``before_queue``) until it can."""
    if lane.budget is not None:
        await lane.budget.reserve(await lane.team_of(env.team), env)


def _line_digest(tp: TopicPartition, line: BatchRequest) -> bytes:
    """What makes two records the same line: its topic (another topic's is another team's
    line, answered to that team) and what it asks, not when it was sent."""
    fields = line.model_dump(mode="json", exclude={"submitted_ts", "api_key"})
    content = orjson.dumps([tp.topic, fields], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(content, digest_size=16).digest()


def _twice(request_id: str, holder: tuple[TopicPartition, int, bytes]) -> DuplicateLine:
    # The first is on the same topic (a team's own topic scopes its ids): its place names
    # nothing of another team's.
    where = f"{holder[0].topic}:{holder[0].partition}@{holder[1]}"
    return DuplicateLine(
        f"another line of the same id ({request_id}, at {where}) is still running: its job or "
        "its custom_id was used twice; this line is not run (send it again once the first is "
        "answered, or give it a custom_id of its own)",
        param="custom_id",
    )


def _salvage(raw: bytes | None, exc: MalformedMessage) -> BatchRequest | None:
    """A record that is not a valid line but names its job and line (a wrong body, a newer
    version, a body nested too deep for any parser): the line its submitter counts on,
    carrying the problem as its error, so it is answered with an error result instead of
    never. None when it names no job and line."""
    fields: object
    try:
        fields = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        # Not JSON orjson takes (nested past 1024 levels, say); its top level may still
        # name the line.
        fields = top_level_strings(raw or b"")
    if not isinstance(fields, dict):
        return None
    team = fields.get("team")
    line_id = fields.get("line_id")
    if type(line_id) is int:  # a number its submitter's code wrote as one: the line it counts
        line_id = str(line_id)
    if isinstance(line_id, str) and len(line_id) > MAX_CUSTOM_ID_CHARS:
        # Answered under an id that fits, the same in every run, that starts as its own.
        digest = hashlib.blake2b(line_id.encode(), digest_size=6).hexdigest()
        line_id = f"{line_id[: MAX_CUSTOM_ID_CHARS - 13]}#{digest}"
    # A team the line cannot name (one too long, say) is left out rather than the line: a
    # team's own topic names its team anyway, and elsewhere the line is answered unrun.
    named = team if isinstance(team, str) and team else None
    for who in dict.fromkeys((named, None)):
        try:
            return BatchRequest(
                job_id=fields.get("job_id"),
                line_id=line_id,
                team=who,
                error=f"not a laneway batch line: {exc}",
            )
        except ValidationError:
            continue
    return None
