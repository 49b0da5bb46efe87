"""Faust's hand-over from table recovery to the agent, made unable to drop input records.

When table recovery ends, Faust (``Recovery.on_recovery_completed`` in faust-streaming
0.15.3) resumes the input partitions, seeks them to the committed offsets and only then
resumes the app's flow control, which empties every stream's queue. The consumer's flow is on
all that time (recovery turned it on to read the changelogs), so while the seek's answer is on
its way the fetcher reads input records from the new position and queues them for the agent;
the resume then drops the ones still queued. Their offsets already count as read, so they are
never fetched again, and once the agent acks later records the commit passes them: those
events are lost. A restart lost one this way in 4 of 34 runs on a loaded machine
(``tests/test_streams_restart.py``): the streams log showed the record handed to the stream's
queue and never to the agent.

The consumer also starts with its flow on, so at the first assignment it can fetch input
records before Faust pauses the new partitions for recovery, and hand them to the agent
before the tables are restored.

``hold_flow_for_recovery`` keeps the consumer's flow off from the start and turns it off
again as recovery hands over; Faust's hand-over turns it back on after the seek and after
emptying the queues, so the agent starts at the committed offsets and nothing is dropped.

A step of recovery that outlasts ``broker_request_timeout`` (a flush, a seek, an offsets
request; 90 s) is taken by Faust for the service stopping (``Recovery._wait``: mode's
``wait_first`` reports a timeout as "stopped"): the recovery loop ends for good, saying so
only at DEBUG, with the flow off. The process stays up and folds nothing, and later
rebalances do not mend it. ``end_on_a_lost_recovery`` makes that a failure the process
exits on, for its supervisor to restart it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from faust.tables.recovery import ServiceStopped

__all__ = ["end_on_a_lost_recovery", "hold_flow_for_recovery"]


def hold_flow_for_recovery(app: Any) -> None:
    """No input record reaches ``app``'s agents until recovery has sought the committed
    offsets and emptied the queues (call before ``app.start()``)."""
    recovery = app.tables.recovery
    hand_over = recovery.on_recovery_completed

    async def on_recovery_completed(generation_id: int = 0) -> None:
        app.consumer.stop_flow()  # Faust's hand-over resumes it once the queues are empty
        await hand_over(generation_id)

    recovery.on_recovery_completed = on_recovery_completed
    app.consumer.stop_flow()  # recovery turns it on for the changelogs alone


def end_on_a_lost_recovery(app: Any, fail: Callable[[str], None]) -> None:
    """Call ``fail`` (with what happened) when a step of ``app``'s table recovery times out,
    which ends Faust's recovery for good while the app is not stopping."""
    recovery = app.tables.recovery
    wait = recovery._wait  # the one place Faust tells a timeout from a stop

    async def _wait(coro: Any, timeout: Any = None) -> None:  # noqa: ASYNC109 - Faust's own
        try:
            await wait(coro, timeout=timeout)
        except ServiceStopped:
            # ``timeout``: the step itself (the hand-over's own wait, which holds the seek's,
            # has none and sees the seek's end go by).
            if timeout is not None and not recovery.should_stop:
                fail(
                    f"a step of table recovery took more than {timeout} s "
                    "(broker_request_timeout); Faust ends its recovery on that, and the "
                    "app would fold nothing more"
                )
            raise

    recovery._wait = _wait
