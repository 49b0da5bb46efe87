"""Faust's aiokafka transport, reading ``read_committed``.

Faust reads its input ``read_committed`` only when the app itself runs transactions
(``processing_guarantee="exactly_once"``, which changes how it commits everything). The batch
lane writes usage events in Kafka transactions, and an aborted one (its line runs again)
must not be counted: this transport reads committed records only, and changes nothing else.
Register it with ``register()``; the app's broker URL then uses the ``laneway://`` scheme.
"""

from __future__ import annotations

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


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> _ReadCommittedThread:
        return _ReadCommittedThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    Consumer = _Consumer


def register() -> None:
    """Make ``laneway://host:port`` broker URLs use this transport."""
    TRANSPORTS.aliases[SCHEME] = f"{__name__}:Transport"
