"""The type-through registry in memory: what may follow which generation, and for how long."""

from __future__ import annotations

from typing import Any

from laneway.schema import RequestEnvelope
from tests.stack import envelope
from workers.reuse import ReuseRegistry


def _keystroke(prompt: str, **fields: Any) -> RequestEnvelope:
    values: dict[str, Any] = {"session": "doc", "seq": 1, "reuse": True, "prompt": prompt}
    return envelope(**{**values, **fields})


def _running(registry: ReuseRegistry, prompt: str, text: str, **fields: Any) -> RequestEnvelope:
    owner = _keystroke(prompt, **fields)
    generation = registry.begin(owner)
    for i, word in enumerate(text.split(" ")[:-1]):
        generation.add(word + " ", i + 1, float(i + 1))
    return owner


def test_typed_text_the_generation_made_follows_it_and_other_text_does_not() -> None:
    registry = ReuseRegistry()
    owner = _running(registry, "def f(", "self, key):\n ")
    follower = registry.match(_keystroke("def f(self, ", seq=2))
    assert follower is not None
    assert (follower.generation.owner, follower.start, follower.kind) == (
        owner.id,
        len("self, "),
        "type-through",
    )
    assert registry.match(_keystroke("def f(selv", seq=3)) is None  # not what it suggested
    assert registry.match(_keystroke("def f(self, key):\n    return", seq=4)) is None  # ahead


def test_only_the_same_team_suffix_and_sampling_settings_follow() -> None:
    registry = ReuseRegistry()
    _running(registry, "x = ", "compute() ")
    assert registry.match(_keystroke("x = comp", team="team-b")) is None
    assert registry.match(_keystroke("x = comp", suffix="\n")) is None
    assert registry.match(_keystroke("x = comp", temperature=0.2)) is None
    assert registry.match(_keystroke("x = comp", reuse=False)) is None
    assert registry.match(_keystroke("x = comp")) is not None


def test_a_finished_generation_is_reusable_until_its_time_to_live_ends() -> None:
    registry = ReuseRegistry(ttl_s=30)
    owner = _running(registry, "import ", "numpy as np ")
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.end("stop", completed=True)
    registry.finished(owner.id)
    follower = registry.match(_keystroke("import num", seq=2), now=generation.finished_at + 29)
    assert follower is not None
    assert follower.kind == "recent"
    assert registry.match(_keystroke("import num", seq=3), now=generation.finished_at + 31) is None


def test_a_generation_cut_short_is_never_served_as_a_whole_answer() -> None:
    registry = ReuseRegistry()
    owner = _running(registry, "for i in ", "range(10): ")
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.end(None, completed=False)  # aborted, or the engine failed
    registry.finished(owner.id)
    assert registry.match(_keystroke("for i in ran", seq=2)) is None


def test_a_generation_whose_abort_is_under_way_takes_no_follower() -> None:
    registry = ReuseRegistry()
    owner = _running(registry, "while ", "True: pass ")
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.stopping = True  # what the worker sets as it asks the engine to abort it
    assert registry.match(_keystroke("while Tr", seq=2)) is None
    assert registry.match(_keystroke("while ", seq=3, session="another")) is None  # coalesced
    # The engine finished it whole before the abort landed: a whole answer again.
    generation.end("stop", completed=True)
    registry.finished(owner.id)
    assert registry.match(_keystroke("while Tr", seq=4)) is not None


def test_memory_is_bounded_by_sessions() -> None:
    registry = ReuseRegistry(max_entries=3)
    for i in range(5):
        _running(registry, "p", "q ", session=f"doc-{i}")
    assert len(registry) == 3


def test_a_keystroke_asking_a_longer_answer_than_the_generation_makes_runs_on_its_own() -> None:
    # The generation stops at its owner's 4 tokens: a follower that asked for 100 would get
    # those 4 marked 'length', a cut it did not ask for.
    registry = ReuseRegistry()
    owner = _running(registry, "def f(", "self, key, value, default):\n ", max_tokens=4)
    assert registry.match(_keystroke("def f(self, ", seq=2, max_tokens=100)) is None
    assert registry.match(_keystroke("def f(", seq=3, max_tokens=100, session=None)) is None
    assert registry.match(_keystroke("def f(self, ", seq=4, max_tokens=4)) is not None
    # Ended on its own ('stop'), it is the whole answer, whatever a follower may ask.
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.end("stop", completed=True)
    registry.finished(owner.id)
    assert registry.match(_keystroke("def f(self, ", seq=5, max_tokens=100)) is not None
