"""The Faust app: one agent folds ``laneway.usage`` into two changelogged tables; timers turn
the tables into breaker levels, hourly rollups and quota factors.

Tables (memory store, rebuilt from their changelog topics on start):
- ``rollups``: (team, class, model, hour) → counts, tokens, latency histogram, cost. These are
  the tumbling one-hour windows (kept 26 h) that both the analyst rollups and the quota
  variance are read from.
- ``outcomes``: (route, team) → ok/error counts in buckets of the sliding breaker window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust
import orjson
import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.clients import kafka_auth, make_redis
from laneway.clock import RedisClock
from laneway.errors import LanewayError
from streams.announce import Announcer
from streams.canary import CanaryWatch
from streams.dedupe import UsageIds
from streams.faust_buffer import drain_before_commit
from streams.faust_flow import end_on_a_lost_recovery, hold_flow_for_recovery
from streams.metrics import EVENTS
from streams.oncall import OnCallWebhook
from streams.processor import UsageProcessor
from streams.settings import StreamsSettings
from streams.shadow import ShadowWatch
from streams.transport import SCHEME, register

__all__ = ["StreamsApp"]

log = logging.getLogger(__name__)

# How often request ids past the de-duplication window are forgotten.
_FORGET_IDS_S = 60.0
# The app's tables; each has a changelog topic "<app id>-<name>-changelog".
TABLES = ("rollups", "outcomes", "usage_ids")
_CANARY_EVAL_S = 1.0  # how often running canaries are looked at (judged once a window)
_SHADOW_EVAL_S = 5.0  # how often shadow comparisons are written (each over its whole window)
_CLOCK_SYNC_S = 30.0  # how often the offset to Redis's clock is learned again
# A process that is not ready (tables recovered, no rebalance under way) folds nothing and
# publishes nothing, and its timers, which Faust starts only after the first recovery, say
# nothing: how often that is looked at, and how often it is said, with where Faust stands.
_READINESS_CHECK_S = 1.0
_NOT_READY_WARN_S = 15.0
# How long a run that a failure to fold restarted skips records that fail to fold.
_SKIP_AFTER_FAILURE_S = 600.0

register()


def _broker_credentials(settings: StreamsSettings) -> faust.SASLCredentials | None:
    """The streams principal's SASL credentials (None on a PLAINTEXT cluster)."""
    auth = kafka_auth(settings)
    if not auth:
        return None
    return faust.SASLCredentials(
        username=auth["sasl_plain_username"],
        password=auth["sasl_plain_password"],
        mechanism=auth["sasl_mechanism"],
        ssl_context=auth.get("ssl_context"),
    )


class StreamsApp:
    """The Faust app plus the clients it needs; ``start()``/``stop()`` own all of them."""

    def __init__(self, settings: StreamsSettings, *, partitions: int) -> None:
        self.settings = settings
        topics = settings.topics
        self.app: Any = faust.App(
            settings.app_id,
            # Faust's aiokafka transport reading committed records only: usage of an aborted
            # batch transaction is not counted (streams/transport.py).
            broker=[f"{SCHEME}://{server}" for server in settings.kafka_bootstrap.split(",")],
            broker_credentials=_broker_credentials(settings),
            store="memory://",
            datadir=settings.streams_data_dir,
            web_enabled=False,
            autodiscover=False,
            topic_partitions=partitions,
            topic_replication_factor=settings.streams_replication_factor,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=settings.streams_commit_interval_s,
            producer_acks=-1,
            # A crashed instance's partitions move on after this, not after Faust's 60 s.
            broker_session_timeout=settings.session_timeout_ms / 1000,
            broker_heartbeat_interval=settings.session_timeout_ms / 3000,
        )
        app = self.app
        drain_before_commit(app)  # no offset commit ahead of the table changelogs
        hold_flow_for_recovery(app)  # no input record dropped as recovery hands over
        end_on_a_lost_recovery(app, self._recovery_lost)  # no process up that folds nothing
        # Faust narrates rebalances at INFO only with its own chatter: these say what moved.
        app.on_partitions_assigned.connect(self._assigned)
        app.on_partitions_revoked.connect(self._revoked)
        self.redis: aioredis.Redis = make_redis(settings)
        # Redis's clock, which the workers stamp usage events on: hours close, windows
        # slide and old records age on it, whatever this machine's clock says.
        self.clock = RedisClock()
        self.webhook = OnCallWebhook(settings.breaker_webhook_url)
        self._outputs = {
            name: app.topic(name, key_serializer="raw", value_serializer="raw")
            for name in (topics.control, topics.usage_hourly)
        }
        self.announcer = Announcer(
            self.redis,
            settings.keys,
            topics.control,
            self._send,
            self.webhook,
            cooldown_s=settings.breaker_cooldown_s,
        )
        self.canary = CanaryWatch(
            settings, self.redis, settings.keys, self._send, self.webhook, clock=self.clock.now
        )
        self.shadow = ShadowWatch(settings, self.redis, settings.keys, clock=self.clock.now)
        self.processor = UsageProcessor(
            settings,
            rollups=app.Table(TABLES[0], key_type=str, partitions=partitions),
            outcomes=app.Table(TABLES[1], key_type=str, partitions=partitions),
            ids=UsageIds(
                app.Table(TABLES[2], key_type=str, partitions=partitions),
                settings.usage_dedupe_s,
            ),
            announcer=self.announcer,
            redis=self.redis,
            keys=settings.keys,
            send=self._send,
            canary=self.canary,
            shadow=self.shadow,
            clock=self.clock.now,
            owned=self._owned,
        )
        usage = app.topic(topics.usage, key_serializer="raw", value_serializer="raw")
        app.agent(usage, name="usage")(self._consume)
        self._timer(settings.breaker_eval_interval_s, "breakers", self._evaluate_breakers)
        self._timer(settings.rollup_flush_interval_s, "rollups", self.processor.publish_rollups)
        self._timer(
            settings.quota_factor_interval_s, "quota-factors", self.processor.update_quota_factors
        )
        self._timer(_FORGET_IDS_S, "usage-ids", self.processor.forget_ids)
        self._timer(_CANARY_EVAL_S, "canaries", self.canary.evaluate)
        self._timer(_SHADOW_EVAL_S, "shadows", self.shadow.evaluate)
        self._timer(_CLOCK_SYNC_S, "clock", self._sync_clock)
        self._levels_restored = False
        # A record the agent could not fold, or recovery lost: what the process reports as
        # it exits.
        self.failure: str | None = None
        self._failed = asyncio.Event()
        # A run that a failure to fold restarted skips the records that fail to fold for a
        # while (one restart per window, not one per failing record).
        self._unfolded = Path(settings.streams_data_dir) / "unfolded.json"
        self._skipping_until = (
            time.monotonic() + _SKIP_AFTER_FAILURE_S if self._after_failure() else 0.0
        )
        # Faust stops the timers last; from the first step of a stop on they do nothing, so no
        # table write can come after the final changelog flush.
        self._stopping = False
        self._watch: asyncio.Future[None] | None = None

    def _owned(self) -> set[int] | None:
        """The usage partitions this instance holds (their changelogs' too); None before it
        has any idea."""
        consumer: Any = getattr(self.app, "_consumer", None)  # app.consumer would make one
        try:
            return set(_usage_partitions(consumer.assignment(), self.settings))
        except Exception:  # noqa: BLE001 - a consumer not started yet has no assignment
            return None

    async def _assigned(self, _app: Any, /, *moved: Any, **_: Any) -> None:
        log.info("partitions assigned: %s", _usage_partitions(moved[0], self.settings))
        self.processor.reindex()

    async def _revoked(self, _app: Any, /, *moved: Any, **_: Any) -> None:
        log.info("partitions revoked: %s", _usage_partitions(moved[0], self.settings))

    async def _consume(self, stream: Any) -> None:
        async for event in stream.events():
            message = event.message
            try:
                self.processor.handle(
                    event.value, message.partition, message.offset, message.timestamp
                )
            except Exception as exc:  # a bug: its record must not be passed over unsaid
                # A malformed record is skipped inside ``handle``; this is a valid one the
                # tables could not take. Left to Faust, the agent would be restarted past it
                # (the record acked, its usage lost) or not at all (nothing folded any more,
                # the process still up).
                where = f"{message.topic}:{message.partition}@{message.offset}"
                if time.monotonic() < self._skipping_until:
                    # This run is the restart a failure caused, and a record fails again: a
                    # bug no restart mends. Skipped, so that it does not hold back every
                    # later record, nor restart the process once a record.
                    log.exception(
                        "usage record %s failed to fold in the run a failure restarted; "
                        "skipped: its usage is not counted (or only in part)",
                        where,
                    )
                    EVENTS.labels("unfolded").inc()
                    continue
                # The agent parks on it unacked, so no commit passes it, and the process
                # exits (``python -m streams``) for its supervisor to restart it, which
                # reads it again with the tables as their changelogs hold them.
                log.exception("usage record %s was not folded", where)
                self._note_failure(where)
                self.failure = f"usage record {where} was not folded: {exc!r}"
                self._failed.set()
                await asyncio.Event().wait()

    def _recovery_lost(self, what: str) -> None:
        if self.failure is None:  # the first failure is the one the process exits on
            self.failure = what
        self._failed.set()

    def _after_failure(self) -> bool:
        """Whether the previous run ended on a record it could not fold (the note is taken
        up: the run after this one starts afresh)."""
        try:
            self._unfolded.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("could not take up %s: %s", self._unfolded, exc)
        return True

    def _note_failure(self, where: str) -> None:
        """Tell the restart (in the data dir, which a restart keeps) how this run ended."""
        try:
            self._unfolded.parent.mkdir(parents=True, exist_ok=True)
            draft = self._unfolded.with_suffix(".draft")
            draft.write_bytes(orjson.dumps({"record": where, "ts": time.time()}))
            draft.replace(self._unfolded)
        except OSError as exc:
            log.warning("could not note %s in %s: %s", where, self._unfolded, exc)

    async def _send(self, topic: str, key: bytes, value: bytes) -> None:
        """Produce one record and return once the broker has it."""
        delivery = await self._outputs[topic].send(key=key, value=value, force=True)
        await delivery

    def _ready(self) -> bool:
        """Tables are complete (recovered from their changelogs, not rebalancing) and the app
        is not stopping."""
        recovery = self.app.tables.recovery
        return bool(
            not self._stopping
            and recovery.completed.is_set()
            and not self.app.rebalancing
            and not getattr(self.app, "in_recovery", False)
        )

    def _state(self) -> str:
        """Where Faust's rebalance and recovery are, for a log line."""
        app = self.app
        recovery = app.tables.recovery
        consumer: Any = getattr(app, "_consumer", None)  # app.consumer would make one
        try:
            partitions: Any = _usage_partitions(consumer.assignment(), self.settings)
        except Exception:  # noqa: BLE001 - a consumer not started yet has no assignment
            partitions = "none yet"
        return (
            f"generation {app.consumer_generation_id}, usage partitions {partitions}, "
            f"rebalancing {app.rebalancing}, reading changelogs {recovery.in_recovery}, "
            f"recovered once {recovery.completed.is_set()}, "
            f"consumer flow {'on' if getattr(consumer, 'flow_active', None) else 'off'}"
        )

    async def _watch_readiness(self) -> None:
        """Say so, every ``_NOT_READY_WARN_S``, while the app is not ready."""
        down = warned = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(_READINESS_CHECK_S)
            now = time.monotonic()
            if self._ready() or self._stopping:
                down = warned = now
            elif now - warned >= _NOT_READY_WARN_S:
                warned = now
                try:
                    state = self._state()
                except Exception as exc:  # noqa: BLE001 - Faust's internals: say, go on
                    state = f"(not known: {exc!r})"
                log.warning("not ready for %.0f s, folding nothing: %s", now - down, state)

    async def _evaluate_breakers(self) -> None:
        """Judge the breakers, once the levels a previous run stored are taken over (a
        restart must not reset them to 0); the other timers do not wait on Redis for them."""
        if not self._levels_restored:
            await self.processor.restore_levels()
            self._levels_restored = True
        await self.processor.evaluate_breakers()

    def _timer(self, interval: float, name: str, work: Callable[[], Awaitable[object]]) -> None:
        """``work`` every ``interval`` while the app is ready."""

        async def tick() -> None:
            if not self._ready():
                return
            try:
                await work()
            except (RedisError, KafkaError, OSError, LanewayError) as exc:
                log.warning("%s timer: %s; retrying on the next tick", name, exc)

        tick.__name__ = f"streams_{name.replace('-', '_')}"
        self.app.timer(interval, name=f"streams.{name}")(tick)

    async def _sync_clock(self) -> None:
        await self.clock.sync(self.redis)

    async def start(self) -> None:
        try:
            await self.clock.sync(self.redis, samples=3)
        except (RedisError, OSError, LanewayError) as exc:
            log.warning("clock not synced with Redis yet (this machine's is used): %s", exc)
        self.app.in_worker = True
        self._watch = asyncio.ensure_future(self._watch_readiness())
        await self.app.start()
        if not self._stopping:  # a stop while the tables recovered ends the start too
            log.info(
                "streams app %s consuming %s", self.settings.app_id, self.settings.topics.usage
            )

    async def wait_crashed(self) -> None:
        """Return when the app stopped by itself, a record could not be folded or table
        recovery was lost (``failure`` says which of the last two)."""
        waiters = {
            asyncio.ensure_future(self.app.wait_until_stopped()),
            asyncio.ensure_future(self._failed.wait()),
        }
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def stop(self) -> None:
        """Stop consuming, flush table changelogs, commit offsets, close the clients."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self.failure is not None:
            # Faust's stop waits for every fetched record to be acked: not the one parked.
            self.app.conf.stream_wait_empty = False
        await self.app.stop()
        await self.webhook.aclose()
        await self.redis.aclose()


def _usage_partitions(tps: set[Any], settings: StreamsSettings) -> list[int]:
    """The usage topic's partitions among ``tps`` (the changelogs' move with them)."""
    return sorted(tp.partition for tp in tps if tp.topic == settings.topics.usage)
