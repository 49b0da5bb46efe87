"""Revoked API keys, as every ingress learns them: from the compacted ``laneway.keys`` topic.

Each replica reads the topic from its start and keeps the hashes in memory, so a revoked key
is refused within moments of its revocation on every replica, and stays refused while Redis
is away (when a replica would otherwise serve a key it knows from its cache). A revocation
made while Redis was away left the key's record there: the replicas delete it as they read,
or once Redis answers again (never waiting on a Redis that hangs: the topic comes first).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.settings import IngressSettings
from laneway.clients import make_consumer
from laneway.errors import MalformedMessage
from laneway.redis_circuit import circuit_of
from laneway.schema import KeyRevocation, decode
from laneway.tasks import kept, stop_task

__all__ = ["RevokedKeys"]

log = logging.getLogger(__name__)

_DELETE_CHUNK = 500  # records deleted per Redis call while the topic is replayed
# Deleting records is background work, but it shares the loop that reads revocations: a
# Redis that hangs may hold that loop back this long, once (then the circuit is open).
_DELETE_TIMEOUT_S = 1.0


class RevokedKeys:
    """``key_hash in revoked``: whether a revocation of it has been read."""

    def __init__(self, settings: IngressSettings, redis: aioredis.Redis) -> None:
        self.keys = settings.keys
        self.redis = redis
        self.circuit = circuit_of(redis)
        self._consumer = make_consumer(settings, settings.topics.keys, auto_offset_reset="earliest")
        self._hashes: set[str] = set()
        self._records_left: list[str] = []  # Redis records not deleted yet
        self._task: asyncio.Task[None] | None = None

    def __contains__(self, key_hash: object) -> bool:
        return key_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, key_hash: str) -> None:
        """A revocation this replica made: refused here from now on, before the topic
        brings it back; its Redis record is deleted as one read off the topic would be."""
        if key_hash not in self._hashes:
            self._hashes.add(key_hash)
            self._records_left.append(key_hash)

    async def start(self) -> None:
        await self._consumer.start()
        self._task = kept("revoked-keys", self._tail)

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        await self._consumer.stop()

    async def _tail(self) -> None:
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                log.warning("revoked keys not read (%s); trying again", exc)
                await asyncio.sleep(1.0)
                continue
            for records in batches.values():
                for record in records:
                    self._add(record.value)
            await self._delete_records()

    def _add(self, raw: bytes | None) -> None:
        try:
            revocation = decode(KeyRevocation, raw)
        except MalformedMessage as exc:
            log.warning("skipped a record on the revoked-keys topic: %s", exc)
            return
        if revocation.hash not in self._hashes:
            self._hashes.add(revocation.hash)
            self._records_left.append(revocation.hash)
            log.debug("API key %s of team %r is revoked", revocation.id, revocation.team)

    async def _delete_records(self) -> None:
        while self._records_left:
            names = [self.keys.api_key(h) for h in self._records_left[:_DELETE_CHUNK]]
            try:
                await self.circuit.background(
                    partial(self.redis.delete, *names), timeout_s=_DELETE_TIMEOUT_S
                )
            except (RedisError, OSError):
                return  # still refused from memory; deleted at the next record or start
            del self._records_left[: len(names)]
