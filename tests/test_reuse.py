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


def test_a_keystroke_that_typed_all_the_suggestion_has_runs_on_its_own() -> None:
    # The user accepted the whole suggestion (Tab): nothing of it is left to give. Served from
    # it, the keystroke got an empty answer reported ok; the IDE wants a fresh suggestion.
    registry = ReuseRegistry()
    owner = _running(registry, "def f(", "x, y): return ", max_tokens=3)
    generation = registry.of_owner(owner.id)
    assert generation is not None
    whole = "def f(" + generation.text
    # Running, but at its owner's max_tokens: its last delta is in, its end not yet noted.
    assert registry.match(_keystroke(whole, seq=2, max_tokens=3)) is None
    assert registry.match(_keystroke("def f(x, y): ", seq=3, max_tokens=3)) is not None
    generation.end("length", completed=True)
    registry.finished(owner.id)
    assert registry.match(_keystroke(whole, seq=4, max_tokens=3)) is None
    # Ended on its own, the same: an empty answer is not a suggestion.
    registry = ReuseRegistry()
    owner = _running(registry, "def f(", "x, y): return ", max_tokens=8)
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.end("stop", completed=True)
    registry.finished(owner.id)
    assert registry.match(_keystroke(whole, seq=2, max_tokens=8)) is None
    assert registry.match(_keystroke("def f(x, y): ", seq=3, max_tokens=8)) is not None


def test_a_follower_is_never_given_more_than_its_own_max_tokens() -> None:
    # An engine may hand several tokens in one delta (vLLM merges outputs; an upstream's chunk
    # counts as one): where inside it a smaller budget ends is unknown, so a keystroke whose
    # own budget could end inside the generation runs on its own.
    registry = ReuseRegistry()
    owner = _keystroke("p", session=None, max_tokens=8)
    generation = registry.begin(owner)
    generation.add("AAAA BBBB CCCC DDDD ", 4, 1.0)
    assert registry.match(_keystroke("p", session=None, max_tokens=2)) is None
    same = registry.match(_keystroke("p", session=None, max_tokens=8))
    assert same is not None
    assert same.kind == "coalesced"
    # A keystroke that typed k tokens of it with the same budget gets at most 8 - k: its cap
    # lies past the generation's own end.
    registry = ReuseRegistry()
    owner = _running(registry, "q = ", "one two three four ", max_tokens=8)
    assert registry.match(_keystroke("q = one two ", seq=2, max_tokens=5)) is None
    assert registry.match(_keystroke("q = one two ", seq=3, max_tokens=6)) is not None
    # Finished on its own with 4 tokens: a budget that reaches past what is left is enough.
    generation = registry.of_owner(owner.id)
    assert generation is not None
    generation.end("stop", completed=True)
    registry.finished(owner.id)
    assert registry.match(_keystroke("q = one ", seq=4, max_tokens=2)) is None
    assert registry.match(_keystroke("q = one ", seq=5, max_tokens=3)) is not None


def test_a_temperature_left_to_the_server_is_not_laneways_default_set() -> None:
    """A request that sets no temperature is sent none (the upstream samples at its own
    default); one that sets 1.0 is sent 1.0. They are not the same request: neither is
    served from the other's generation."""
    registry = ReuseRegistry()
    registry.begin(_keystroke("r", session=None, unset=["top_p"]))  # temperature 1.0, set
    assert registry.match(_keystroke("r", session=None, unset=["temperature", "top_p"])) is None
    assert registry.match(_keystroke("r", session=None, unset=["top_p"])) is not None
