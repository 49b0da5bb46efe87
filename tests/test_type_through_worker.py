"""Type-through on a worker whose engine the test steps: a follower left nothing by its
generation, a rebalance that moves a follower's partition, a superseded request that starts for
its followers, and a tombstone that comes before a follower is known to the shield."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition

from laneway.schema import CancelRecord, RequestEnvelope
from tests.scripted_engine import ScriptedSim
from tests.stack import PARTITIONS, LiveStack, envelope, eventually, partition_of
from workers.dispatch import Work

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "omega ", "sigma "]


def _keystroke(prompt: str, **fields: Any) -> RequestEnvelope:
    values: dict[str, Any] = {"session": "doc", "seq": 1, "reuse": True, "max_tokens": 16}
    return envelope(**{**values, "prompt": prompt, **fields})


def _affinity_of_each_partition() -> dict[int, str]:
    """An affinity whose records the producer's partitioner puts on each partition."""
    found: dict[int, str] = {}
    for i in range(100):
        affinity = f"s:doc-{i}"
        found.setdefault(partition_of(affinity), affinity)
    return found


async def test_a_keystroke_its_generation_left_nothing_to_give_runs_on_its_own(
    stack: LiveStack,
) -> None:
    """The user typed all the suggestion had made so far, and its next output was its end
    with no more text (an engine's last delta often carries only the finish reason). The
    keystroke that followed it got an empty answer reported ok; it runs on its own now."""
    engine = ScriptedSim()
    worker = await stack.start_worker("completion", engine=engine)
    engine.answers["def main():"] = ["alpha ", "beta ", ""]
    first = _keystroke("def main():")
    engine.hold[first.id] = 2  # its two words out, the empty end kept back
    await stack.send_records(first)
    await eventually(lambda: first.id in engine.holding, 20, "the first keystroke's words")
    typed = _keystroke("def main():alpha beta ", seq=2)
    await stack.send_records(typed)
    await eventually(lambda: typed.id in worker.runs.following, 20, "the keystroke following")
    await engine.let_go()
    usage = await stack.usage_of(first.id, typed.id)
    assert (usage[typed.id]["status"], usage[typed.id]["reused_from"]) == ("ok", None)
    assert usage[typed.id]["completion_tokens"] > 0
    assert engine.runs[typed.id] == 1
    assert usage[first.id]["status"] == "superseded"
    await eventually(lambda: not worker.runs.tasks, 20, "every run ended")
    assert await stack.usage_counts({first.id, typed.id}) == {first.id: 1, typed.id: 1}


async def test_followers_of_a_partition_that_went_to_another_worker_stop_there(
    stack: LiveStack,
) -> None:
    """A second worker joins while the first runs a suggestion on each partition, each
    followed by a keystroke of its session (type-through) and by an identical request on the
    other partition (coalesced). What the moved partition holds stops on the first worker and
    reports nothing there (the newcomer answers it, once): its followers at once, its
    suggestion once no follower on a kept partition is left. What stayed runs on."""
    first_engine, second_engine = ScriptedSim(), ScriptedSim()
    first = await stack.start_worker("completion", engine=first_engine)
    affinity = _affinity_of_each_partition()
    assert len(affinity) == PARTITIONS == 2
    leaders, typed, same = {}, {}, {}
    for p in (0, 1):
        prompt = f"def task_{p}():"
        first_engine.answers[prompt] = second_engine.answers[prompt] = WORDS
        # A grace of 1 token: a keystroke typing through it leaves it to its own client.
        leaders[p] = _keystroke(
            prompt, session=f"doc-{p}", affinity=affinity[p], supersede_grace_tokens=1
        )
        first_engine.hold[leaders[p].id] = 2
    await stack.send_records(*leaders.values())
    await eventually(
        lambda: first_engine.holding == {env.id for env in leaders.values()}, 20, "both held"
    )
    for p in (0, 1):
        typed[p] = _keystroke(
            leaders[p].prompt + WORDS[0], session=f"doc-{p}", seq=2, affinity=affinity[p]
        )
        # Another session's identical request, on the other partition.
        same[p] = _keystroke(leaders[1 - p].prompt, session=None, seq=None, affinity=affinity[p])
    await stack.send_records(*typed.values(), *same.values())
    followers = {env.id for env in (*typed.values(), *same.values())}
    await eventually(lambda: set(first.runs.following) == followers, 20, "all four following")

    second = await stack.start_worker("completion", engine=second_engine, wait_assigned=False)
    topic = stack.topics.request("completion", "hi")

    def split() -> bool:
        mine = {tp.partition for tp in first.consumer.assignment() if tp.topic == topic}
        theirs = {tp.partition for tp in second.consumer.assignment() if tp.topic == topic}
        return len(mine) == len(theirs) == 1

    await eventually(split, 60, "the partitions split between the workers")
    (gone,) = {tp.partition for tp in second.consumer.assignment() if tp.topic == topic}
    kept = 1 - gone
    moved = {leaders[gone].id, typed[gone].id, same[gone].id}
    answers = await stack.usage_of(*moved)
    assert {e["worker"] for e in answers.values()} == {second.settings.worker_id}
    await eventually(
        lambda: not {typed[gone].id, same[gone].id} & set(first.runs.following),
        20,
        "the moved followers gone from the first worker",
    )
    # The moved suggestion runs on for the identical request of the kept partition...
    assert leaders[gone].id in first_engine.holding
    assert leaders[gone].id not in first_engine.aborts
    # ... until that one's client leaves.
    await stack.send_records(CancelRecord(id=same[kept].id, team=same[kept].team))
    await eventually(
        lambda: leaders[gone].id in first_engine.aborts, 20, "the moved suggestion stopped"
    )
    assert leaders[kept].id not in first_engine.aborts

    await first_engine.let_go()
    stayed = await stack.usage_of(leaders[kept].id, typed[kept].id, same[kept].id)
    assert {e["worker"] for e in stayed.values()} == {first.settings.worker_id}
    assert stayed[typed[kept].id]["status"] == "ok"
    assert stayed[typed[kept].id]["reused_from"] == leaders[kept].id
    assert stayed[same[kept].id]["status"] == "cancelled"
    await eventually(lambda: not first.runs.tasks, 20, "the first worker's runs ended")
    everything = {env.id for env in (*leaders.values(), *typed.values(), *same.values())}
    assert await stack.usage_counts(everything) == dict.fromkeys(everything, 1)


async def _stale_owner_left_by_its_follower(
    stack: LiveStack, words: list[str], hold_at: int, session: str
) -> tuple[ScriptedSim, RequestEnvelope, asyncio.Task[Any], asyncio.Task[Any]]:
    """A keystroke follows a suggestion the dispatcher just handed to the engine, and
    supersedes it before its run began: it starts for the follower, and is held at its token
    ``hold_at``; then the follower's client leaves. Returns the engine, the owner, and the
    owner's run and the follower's service, both under way."""
    engine = ScriptedSim()
    worker = await stack.start_worker("completion", engine=engine)
    executor, shield = worker.executor, worker.shield
    engine.answers["def main():"] = words
    owner = _keystroke("def main():", session=session)
    engine.hold[owner.id] = hold_at
    executor.reuse.begin(owner)  # what the dispatcher does as it starts it
    newer = _keystroke("def main():", session=session, seq=2)
    follower = executor.reuse.match(newer)
    assert follower is not None
    assert shield.observe(newer) == []  # not running yet: nothing to abort
    shield.started(newer)
    run = asyncio.create_task(executor.run(owner))
    served = asyncio.create_task(executor.follow(follower))
    await eventually(lambda: owner.id in engine.holding, 20, "the suggestion running")
    rid = shield.cancel(CancelRecord(id=newer.id, team=newer.team))
    assert rid == newer.id
    await executor.abort(rid)
    return engine, owner, run, served


async def test_a_superseded_request_that_starts_for_its_followers_is_told_so(
    stack: LiveStack,
) -> None:
    """Its own client is told it was superseded (not sent the text, not charged it), and once
    the follower's client leaves, the engine stops it: nobody wants it."""
    engine, owner, run, served = await _stale_owner_left_by_its_follower(stack, WORDS, 2, "doc-5")
    await eventually(lambda: owner.id in engine.aborts, 20, "the suggestion stopped")
    usage = await run
    assert usage is not None
    assert (usage.status, usage.completion_tokens) == ("superseded", 0)
    assert (await served).status == "cancelled"


async def test_a_tombstone_that_comes_before_a_follower_starts_ends_it(stack: LiveStack) -> None:
    """The cancel feed runs beside the fetch loop: a keystroke's tombstone may come after it
    was matched to a generation and before it is known to the shield as running. It is not
    lost: the keystroke ends cancelled, the generation is not followed for it."""
    engine = ScriptedSim()
    worker = await stack.start_worker("completion", engine=engine)
    engine.answers["def main():"] = WORDS
    owner = _keystroke("def main():", session="doc-6")
    engine.hold[owner.id] = 2
    await stack.send_records(owner)
    await eventually(lambda: owner.id in engine.holding, 20, "the suggestion running")
    typed = _keystroke("def main():" + WORDS[0], session="doc-6", seq=2)
    follower = worker.runs.reusable(typed)
    assert follower is not None
    assert worker.shield.cancel(CancelRecord(id=typed.id, team=typed.team)) is None
    worker.runs.follow(Work(TopicPartition("elsewhere", 0), 0, typed, 0), follower)
    (usage,) = (await stack.usage_of(typed.id)).values()
    assert (usage["status"], usage["completion_tokens"]) == ("cancelled", 0)
    assert not follower.generation.followers
    await engine.let_go()
    (usage,) = (await stack.usage_of(owner.id)).values()
    assert usage["status"] == "ok"


async def test_a_stale_owner_whose_followers_left_before_its_first_token_stays_stale(
    stack: LiveStack,
) -> None:
    """The follower it started for leaves before the suggestion's first (and last) token
    comes: that token reaches no one as an answer. The superseded owner is told so, not sent
    the text as its answer nor charged for it."""
    engine, _, run, served = await _stale_owner_left_by_its_follower(stack, ["alpha "], 0, "doc-7")
    await engine.let_go()
    usage = await run
    assert usage is not None
    assert (usage.status, usage.completion_tokens) == ("superseded", 0)
    assert (await served).status == "cancelled"
