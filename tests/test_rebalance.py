"""Rebalances of an interactive pool on the real broker: what was answered is not run again,
what runs of a partition that went elsewhere stops, and preemption counts are kept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from tests.scripted_engine import ScriptedSim
from tests.stack import (
    PARTITIONS,
    LiveStack,
    envelope,
    eventually,
    long_prompt,
    partition_of,
    sim_answer_tokens,
)
from workers.pool import PoolWorker


async def _rebalance(worker: PoolWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker rejoins its group: its partitions are revoked and assigned again (it is
    the group's only member, so to it). Returns once they were assigned."""
    assign, assigned = worker.lane.assigned, asyncio.Event()

    async def noted(partitions: set[Any]) -> None:
        await assign(partitions)
        assigned.set()

    monkeypatch.setattr(worker.lane, "assigned", noted)
    worker.consumer._coordinator.request_rejoin()
    await asyncio.wait_for(assigned.wait(), 30)


async def test_requests_answered_above_a_held_one_are_not_run_again_after_a_rebalance(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long request holds its partition's committed offset back while those behind it are
    answered. A rebalance that gives the partition back makes the worker read it again from
    there: the answered ones are skipped (the commit named them), and the held one and one
    whose usage event was still on its way when the partition was revoked finish as the
    runs they were in, not as second runs."""
    engine = ScriptedSim()
    worker = await stack.start_worker("completion", engine=engine)
    held = envelope(prompt=long_prompt(4))
    engine.hold[held.id] = 0
    quick = [envelope(prompt=f"def quick_{i}():") for i in range(3)]
    reporting = envelope(prompt="def reporting():")
    delivered, on_its_way, stored = (
        worker.executor.reports.delivered,
        asyncio.Event(),
        asyncio.Event(),
    )

    async def slow_delivery(request_id: str) -> None:
        if request_id == reporting.id:
            on_its_way.set()
            await stored.wait()
        await delivered(request_id)

    monkeypatch.setattr(worker.executor.reports, "delivered", slow_delivery)
    await stack.send_records(held, quick[0], reporting, quick[1], quick[2])
    await stack.usage_of(*(env.id for env in quick))
    await asyncio.wait_for(on_its_way.wait(), 20)
    await eventually(lambda: held.id in engine.holding, 20, "the held request on the engine")
    await eventually(lambda: worker.offsets.in_flight() == 2, 20, "the quick ones finished")

    await _rebalance(worker, monkeypatch)
    # Taken after the records before it: each of those was skipped, adopted or queued.
    marker = envelope(prompt="def marker():")
    await stack.send_records(marker)
    await stack.usage_of(marker.id)
    stored.set()
    await engine.let_go()
    await stack.usage_of(held.id)
    await stack.usage_of(reporting.id)
    await eventually(lambda: not worker.runs.tasks, 20, "every run ended")

    ours = [held, *quick, reporting, marker]
    assert {env.id: engine.runs[env.id] for env in ours} == {env.id: 1 for env in ours}
    assert await stack.usage_counts({env.id for env in ours}) == {env.id: 1 for env in ours}


async def test_a_run_that_answers_while_its_partition_is_away_is_not_run_again(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The partition is revoked while a request runs; the run answers before the partition
    comes back to this worker, so nothing is left to adopt its record fetched again (the
    revoke's commit named it pending): it is skipped, not run a second time."""
    engine = ScriptedSim()
    worker = await stack.start_worker("completion", engine=engine)
    held = envelope(prompt=long_prompt(4))
    engine.hold[held.id] = 0
    await stack.send_records(held)
    await eventually(lambda: held.id in engine.holding, 20, "the held request on the engine")

    assign = worker.lane.assigned

    async def after_the_answer(partitions: set[Any]) -> None:
        # Between the revoke and the assignment: the run ends and its usage is stored.
        await engine.let_go()
        await stack.usage_of(held.id)
        await eventually(lambda: not worker.runs.unfinished, 20, "the run's end")
        await assign(partitions)

    monkeypatch.setattr(worker.lane, "assigned", after_the_answer)
    await _rebalance(worker, monkeypatch)
    marker = envelope(prompt="def marker():")
    await stack.send_records(marker)
    await stack.usage_of(marker.id)
    await eventually(lambda: not worker.runs.tasks, 20, "every run ended")
    assert engine.runs[held.id] == 1
    assert await stack.usage_counts({held.id}) == {held.id: 1}


@pytest.mark.parametrize("step", ["first", "last"])
async def test_a_request_whose_partition_went_to_another_worker_stops_there(
    stack: LiveStack, step: str
) -> None:
    """A second worker joins while the first runs a long request on each partition: the one
    whose partition went to the newcomer stops on the first worker (the newcomer runs it and
    answers it, once); the one whose partition stayed runs on, and is answered once. An
    abort that comes during the last step does not stop the run, which then reports nothing
    (its client had two answers)."""
    first_engine, second_engine = ScriptedSim(), ScriptedSim()
    first = await stack.start_worker("completion", engine=first_engine)
    affinities: dict[int, str] = {}
    for i in range(100):
        affinities.setdefault(partition_of(f"s:doc-{i}"), f"s:doc-{i}")
    long = {p: envelope(prompt=long_prompt(4), affinity=a) for p, a in affinities.items()}
    assert len(long) == PARTITIONS == 2
    for env in long.values():
        last = sim_answer_tokens(env.prompt or "", max_tokens=env.max_tokens) - 1
        first_engine.hold[env.id] = 0 if step == "first" else last
    await stack.send_records(*long.values())
    await eventually(
        lambda: first_engine.holding == {env.id for env in long.values()}, 20, "both held"
    )

    second = await stack.start_worker("completion", engine=second_engine, wait_assigned=False)
    topic = stack.topics.request("completion", "hi")

    def split() -> bool:
        mine = {tp.partition for tp in first.consumer.assignment() if tp.topic == topic}
        theirs = {tp.partition for tp in second.consumer.assignment() if tp.topic == topic}
        return len(mine) == len(theirs) == 1

    await eventually(split, 60, "the partitions split between the workers")
    (gone,) = {tp.partition for tp in second.consumer.assignment() if tp.topic == topic}
    moved, kept = long[gone], long[1 - gone]
    await eventually(lambda: moved.id in first_engine.aborts, 20, "the moved request stopped")
    (answer,) = (await stack.usage_of(moved.id)).values()
    assert (answer["worker"], answer["status"]) == (second.settings.worker_id, "ok")
    assert kept.id in first_engine.holding
    assert kept.id not in first_engine.aborts

    await first_engine.let_go()
    (answer,) = (await stack.usage_of(kept.id)).values()
    assert (answer["worker"], answer["status"]) == (first.settings.worker_id, "ok")
    await eventually(lambda: not first.runs.tasks, 20, "the first worker's runs ended")
    assert second_engine.runs == {moved.id: 1}
    assert await stack.usage_counts({moved.id, kept.id}) == {moved.id: 1, kept.id: 1}


async def test_a_shed_is_counted_once_it_took_effect_and_across_a_rebalance(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory pressure aborts two lo-band requests: one's abort comes during its last step
    and it ends ``ok`` as it would have (not shed, nothing counted), the other's takes
    effect. That one waits in the queue while a rebalance gives its partition back, and
    its usage event still counts the preemption when it runs."""
    engine = ScriptedSim()
    worker = await stack.start_worker(
        "completion", engine=engine, memory_check_ms=20, memory_cooldown_s=0.2
    )
    ending = envelope(band="lo", prompt="def ending():")
    shed = envelope(band="lo", prompt=long_prompt(4))
    engine.hold[ending.id] = sim_answer_tokens("def ending():", max_tokens=64) - 1
    engine.hold[shed.id] = 0
    await stack.send_records(ending, shed)
    await eventually(lambda: engine.holding == {ending.id, shed.id}, 20, "both on the engine")

    engine.hold_kv(0.95)
    await eventually(lambda: engine.aborts >= {ending.id, shed.id}, 20, "both asked to stop")
    (event,) = (await stack.usage_of(ending.id)).values()
    assert (event["status"], event["preempted"]) == ("ok", 0)
    await eventually(lambda: len(worker.queue) == 1, 20, "the shed one queued again")

    await _rebalance(worker, monkeypatch)
    engine.hold_kv(0.0)
    (event,) = (await stack.usage_of(shed.id)).values()
    assert (event["status"], event["preempted"]) == ("ok", 1)
    assert engine.runs[shed.id] == 2
    assert worker.memory.shed_total == 1
    control = await stack.read_topic(
        stack.topics.control,
        count=2,
        where=lambda r: r.get("kind") == "memory" and r["worker"] == worker.settings.worker_id,
    )
    assert [(r["pressed"], r["shed"]) for r in control] == [(True, 0), (False, 1)]


async def test_a_revoke_whose_commit_fails_still_forgets_the_partitions(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit in the revoke callback that fails with any Kafka error (not only the
    rebalance's own) still leaves the partitions to their next owner: aiokafka swallows the
    callback's error, and a worker that kept them would run and finish their work as its."""
    worker = await stack.start_worker("completion")

    async def unreachable(*_args: Any, **_kwargs: Any) -> None:
        raise KafkaConnectionError("the coordinator is unreachable")

    monkeypatch.setattr(worker.consumer, "commit", unreachable)
    request = envelope(prompt="def revoked():")
    await stack.send_records(request)
    await stack.usage_of(request.id)
    await eventually(worker.offsets.partitions, 20, "an offset to commit")
    await worker.lane.revoked(set(worker.consumer.assignment()))
    assert worker.offsets.partitions() == []
