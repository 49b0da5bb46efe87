"""Faust's aiokafka transport, reading ``read_committed`` and seeking every input partition.

Faust reads its input ``read_committed`` only when the app itself runs transactions
(``processing_guarantee="exactly_once"``, which changes how it commits everything). The batch
lane writes usage events in Kafka transactions, and an aborted one (its line runs again)
must not be counted: this transport reads committed records only.
Register it with ``register()``; the app's broker URL then uses the ``laneway://`` scheme.

It also makes Faust's seek to the committed offsets (``Consumer.perform_seek``) seek every input
partition. aiokafka's ``seek_to_committed`` leaves a partition with no committed offset (or 0)
where its fetch position is; Faust seeks there at each hand-over from recovery, and its fetcher
does when it gets records while its flow is off, dropping them as the seek will read them
again. For a partition no commit reached yet (the first minutes of a topic, or a run that
failed before its first commit) that seek did nothing, and the dropped records were lost: a
restart folded none of a partition's backlog, and the next commit passed it. Such a partition
now goes back to its start, where the group would begin it (``auto_offset_reset=earliest``);
what it reads again is counted once (``streams.tables``). Table changelogs are left to
recovery, which places them itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["SCHEME", "register"]

SCHEME = "laneway"


class _ReadCommittedThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka takes the level at start(), from this attribute its constructor set: the
        # one place Faust offers no way to pass it.
        consumer._isolation_level = "read_committed"
        return consumer

    async def seek_to_committed(self) -> Mapping[Any, int]:
        """Seek every assigned partition to its committed offset, and an input partition
        with none to its start (aiokafka leaves those where they are)."""
        committed: Mapping[Any, int] = await self.call_thread(self._seek_to_committed)
        return committed

    async def _seek_to_committed(self) -> Mapping[Any, int]:
        consumer = self._ensure_consumer()
        committed: Mapping[Any, int] = await consumer.seek_to_committed()
        unstarted = [
            tp
            for tp, offset in committed.items()
            if not offset and not self.consumer._is_changelog_tp(tp)
        ]
        if unstarted:
            # Sought to the offsets themselves: aiokafka's ``seek_to_beginning`` leaves the
            # partition without a position until its reset is done, and Faust's livelock check
            # reads that position from the app's thread (an AssertionError that stopped it).
            starts = await consumer.beginning_offsets(unstarted)
            assigned = consumer.assignment()  # a rebalance may have taken some meanwhile
            for tp, offset in starts.items():
                if tp in assigned:
                    consumer.seek(tp, offset)
        return committed


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> _ReadCommittedThread:
        return _ReadCommittedThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    Consumer = _Consumer


def register() -> None:
    """Make ``laneway://host:port`` broker URLs use this transport."""
    TRANSPORTS.aliases[SCHEME] = f"{__name__}:Transport"
