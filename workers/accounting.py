"""What a finished request is charged: its quota settlement in Redis, its usage event on Kafka.

A settlement rides in the round trip of the request's final reply (``workers.round_trips``).
When Redis is not reached it is owed: kept, and sent once Redis answers again. Settlement is
idempotent per request id, so one that did reach Redis (its answer lost) is not charged twice.
The usage event is the record (billing, quotas' measured factor, the breaker): it is handed
to the producer, and the caller waits for the broker before the request's offset may move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from laneway.constants import Topics
from laneway.schema import RequestEnvelope, UsageEvent
from quota import QuotaEnforcer
from workers.round_trips import Command, RoundTrips

__all__ = ["Accounting", "Owed"]

log = logging.getLogger(__name__)

# Owed settlements are sent in the background, one at a time, each within this long.
_OWED_SETTLE_TIMEOUT_S = 1.0
# Settlements owed at most: an outage's worth at thousands of requests a second. Beyond it
# the oldest are given up (and logged): a worker's memory is not the record, usage events are.
_MAX_OWED = 200_000
# A stopping worker tries to pay what it owes for this long at most.
_STOP_SETTLE_S = 5.0


@dataclass(frozen=True, slots=True)
class Owed:
    """A request's settlement, until Redis is known to have it."""

    team: str
    request_id: str
    tokens: int
    leased: int
    local: int
    accepted_ts: float
    once: bool = False  # a batch line: a re-run's reservation goes back (``QuotaEnforcer``)
    min_charge: int | None = None  # charged when it used no tokens (None: the policy's)

    @property
    def key(self) -> str:
        """Its place among the owed: a batch line's is its record's (two records of one id
        are two lines, each owing its own settlement)."""
        return f"{self.request_id}@{self.accepted_ts!r}" if self.once else self.request_id


class Accounting:
    def __init__(
        self,
        quota: QuotaEnforcer | None,
        producer: AIOKafkaProducer,
        topics: Topics,
        round_trips: RoundTrips,
    ) -> None:
        self.quota = quota
        self.producer = producer
        self.topics = topics
        self.circuit = round_trips.circuit
        self.circuit.listen(self._on_circuit)
        self.owed: dict[str, Owed] = {}  # by ``Owed.key``, oldest first
        self._paying: asyncio.Task[int] | None = None

    def settlement(self, env: RequestEnvelope, usage: UsageEvent) -> Owed | None:
        """What ``env`` is to be charged (None without quotas, and for a shadow route's
        mirror: nothing was reserved for it, and it is not billed)."""
        if self.quota is None or env.shadow:
            return None
        return Owed(
            env.team,
            env.id,
            usage.prompt_tokens + usage.completion_tokens,
            env.quota_leased,
            env.quota_local,
            env.accepted_ts,
            once=env.cls == "batch",
            # Refused by an engine without what it asks (the route's shortfall, not the
            # team's request): not charged the minimum a request that used nothing pays.
            min_charge=0 if usage.status == "unsupported" else None,
        )

    def commands(self, owed: Owed | None) -> list[Command]:
        """The settlement's Redis command, to share a round trip with the final reply."""
        if owed is None or self.quota is None:
            return []
        return [
            self.quota.settle_command(
                owed.team,
                owed.request_id,
                owed.tokens,
                leased=owed.leased,
                local=owed.local,
                accepted_ts=owed.accepted_ts,
                once=owed.once,
                min_charge=owed.min_charge,
            )
        ]

    async def settled(self, owed: Owed | None, results: list[Any]) -> None:
        """Check the settlement's results: one that Redis lost with its scripts (it
        restarted) is sent again, loading the script, and so is one that charges a pool
        whose bucket is gone (it needs the team's budget, which ``settle`` reads); raises
        what Redis refused otherwise."""
        for result in results:
            if isinstance(result, NoScriptError) and owed is not None:
                await self.circuit.hot(partial(self._settle, owed))
            elif isinstance(result, Exception):
                raise result
            elif owed is not None and self.quota is not None and self.quota.needs_base(result):
                # Rare (a team idle for hours, a new one, a Redis that lost its data), and
                # three round trips: not held to the request path's timeout.
                await self.circuit.background(
                    partial(self._settle, owed), timeout_s=_OWED_SETTLE_TIMEOUT_S
                )
        if self.owed:
            self._pay_owed_soon()  # Redis answers: what an outage left is due

    async def send_usage(self, usage: UsageEvent) -> asyncio.Future[object]:
        """Hand a usage event to the producer; the future says when the broker stored it. A
        producer that cannot take it now (its buffer full past its timeout) fails the future,
        not the call: whoever awaits the delivery sends it again."""
        try:
            delivery: asyncio.Future[object] = await self.producer.send(
                self.topics.usage, usage.to_json(), key=usage.team.encode()
            )
        except KafkaError as exc:
            delivery = asyncio.get_running_loop().create_future()
            delivery.set_exception(exc)
        return delivery

    def owe(self, owed: Owed) -> None:
        """Keep a settlement Redis may not have seen, to send once it answers (idempotent:
        one that did reach it is not charged again)."""
        if not self.owed:
            log.warning("quota settlements wait until Redis answers (from %s)", owed.request_id)
        self.owed[owed.key] = owed
        while len(self.owed) > _MAX_OWED:
            lost = self.owed.pop(next(iter(self.owed)))
            log.warning(
                "settlement of %s given up (over %d owed): %d tokens of team %r not charged",
                lost.request_id,
                _MAX_OWED,
                lost.tokens,
                lost.team,
            )
        if not self.circuit.open:
            self._pay_owed_soon()  # one write failed, Redis still answers others

    def _on_circuit(self, opened: bool) -> None:
        if not opened:
            self._pay_owed_soon()

    def _pay_owed_soon(self) -> None:
        if self.owed and (self._paying is None or self._paying.done()):
            self._paying = asyncio.create_task(self.pay_owed(), name="owed-settlements")

    async def pay_owed(self) -> int:
        """Send the owed settlements, oldest first, until one fails; returns how many went."""
        paid = 0
        while self.owed:
            owed = next(iter(self.owed.values()))
            try:
                await self.circuit.background(
                    partial(self._settle, owed), timeout_s=_OWED_SETTLE_TIMEOUT_S
                )
            except ResponseError as exc:
                # Redis answered, and refused this one: it would refuse it again, and hold
                # every settlement behind it for good.
                log.error(  # noqa: TRY400 - Redis's answer says it all
                    "settlement of %s refused by Redis, given up: %d tokens of team %r not "
                    "charged: %s",
                    owed.request_id,
                    owed.tokens,
                    owed.team,
                    exc,
                )
            except (RedisError, OSError) as exc:
                log.info("owed settlements wait (%d): %s", len(self.owed), exc)
                break
            else:
                paid += 1
            if self.owed.get(owed.key) is owed:  # not one owed again meanwhile
                del self.owed[owed.key]
        if paid:
            log.warning("%d owed settlements sent, %d still owed", paid, len(self.owed))
        return paid

    async def _settle(self, owed: Owed) -> None:
        if self.quota is None:
            return  # nothing is owed without quotas
        await self.quota.settle(
            owed.team,
            owed.request_id,
            owed.tokens,
            leased=owed.leased,
            local=owed.local,
            accepted_ts=owed.accepted_ts,
            once=owed.once,
            min_charge=owed.min_charge,
        )

    async def close(self) -> None:
        """Stop paying in the background; one last try for what is owed (5 s at most)."""
        paying, self._paying = self._paying, None
        if paying is not None:
            paying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await paying
        if self.owed and not self.circuit.open:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STOP_SETTLE_S):
                    await self.pay_owed()
        if self.owed:
            log.warning("%d quota settlements owed at stop are not charged", len(self.owed))
