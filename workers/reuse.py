"""Type-through: a keystroke that types what its session's completion suggests reuses it.

The worker that owns a session (same session → same partition → same worker) remembers the
generation of its session's latest completion, running or just finished. A newer keystroke
whose prompt is that generation's prompt plus text the generation has produced already
(the user typed the ghost text), with the same suffix and sampling settings, is served from
it: what was generated past the typed text goes out at once, the rest as it comes. No new
engine request, no prefill. Two in-flight completions of one team with the same prompt,
suffix and settings share one generation the same way (nothing typed).

A generation keeps running while anyone follows it: its own request turning stale (the
client moved on) no longer aborts it then; the last follower leaving does. Finished
generations stay reusable for ``ttl_s`` (at most ``max_entries`` sessions), by the hash and
length of their prompt and their text: bounded memory per worker. Nothing is shared between
workers: after a restart nothing matches and requests simply run.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from laneway.schema import RequestEnvelope
from laneway.tokens import estimate_tokens

__all__ = ["Follower", "Generation", "ReuseRegistry"]

# route, suffix hash, temperature, top_p, penalties, stop, the client's seed, what it left unset
Settings = tuple[str, str, float, float, float, float, tuple[str, ...], int | None, tuple[str, ...]]


def _own_run_repeats(env: RequestEnvelope) -> bool:
    """Whether ``env``'s own run would write what following a generation that its prompt
    typed into gives it. Not with a client's own seed at a temperature: it asks for the same
    answer every time it sends the request, and the continuation of another prompt's sample
    is not its seed's sample (sent again when nothing is left to follow, it would get another
    answer). Nor with a penalty, even greedily: penalties weigh what a run wrote, the typed
    text included, and not a prompt."""
    if env.seed is not None and env.temperature > 0:
        return False
    return not (env.presence_penalty or env.frequency_penalty)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _settings(env: RequestEnvelope) -> Settings:
    suffix = _digest(env.suffix or "").hex()
    return (
        env.route,
        suffix,
        env.temperature,
        env.top_p,
        env.presence_penalty,
        env.frequency_penalty,
        tuple(env.stop),
        env.seed,
        # Unset, a server samples at its own default: not the same as laneway's value set.
        tuple(sorted(env.unset)),
    )


@dataclass(eq=False)
class Generation:
    """One engine request's output, as followers need it."""

    owner: str  # the request that drives the engine
    team: str
    session: str | None
    prompt_len: int
    prompt_hash: bytes
    settings: Settings
    max_tokens: int = 0  # its owner's: the most tokens it makes
    streamed: bool = False  # its owner's client gets its text as it comes
    text: str = ""
    ends: list[int] = field(default_factory=list)  # text length after each token's delta
    engine_ms: float = 0.0
    prompt_tokens: int = 0  # the engine's count of its prompt, once it says (else 0)
    done: bool = False
    stopping: bool = False  # an abort of its engine request is under way
    finish_reason: str | None = None
    followers: dict[str, Follower] = field(default_factory=dict)
    served: int = 0  # followers it sent text, ever (its engine time was of use)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float = 0.0

    @property
    def tokens(self) -> int:
        return len(self.ends)

    @property
    def shown(self) -> bool:
        """Whether its owner's client may have shown some of its text: only a suggestion the
        user saw is typed through on purpose (a non-streamed one is shown once it ended)."""
        return self.streamed and bool(self.text)

    def tokens_within(self, chars: int) -> int:
        """Tokens whose text ends at or before ``chars``."""
        return bisect.bisect_right(self.ends, chars)

    def add(self, text: str, tokens: int, engine_ms: float, prompt_tokens: int = 0) -> None:
        """A delta: ``tokens`` is the generation's token count so far."""
        self.prompt_tokens = prompt_tokens or self.prompt_tokens
        self.text += text
        while len(self.ends) < tokens:
            self.ends.append(len(self.text))
        if self.ends:
            self.ends[-1] = len(self.text)
        self.engine_ms = engine_ms
        self.wake()

    def prompt_tokens_of(self, env: RequestEnvelope) -> int:
        """The prompt tokens of ``env``, which follows it: its own prompt's count where the
        engine gave one, plus the text it typed, estimated. The same prompt twice is billed
        the same, whether it ran or followed (the ingress's estimate of it may differ)."""
        if not self.prompt_tokens:
            return env.prompt_tokens
        return self.prompt_tokens + estimate_tokens(env.prompt[self.prompt_len :])

    def end(self, finish_reason: str | None, completed: bool) -> None:
        self.done = True
        self.finish_reason = finish_reason if completed else None
        self.finished_at = time.monotonic()
        self.wake()

    def wake(self) -> None:
        """Followers look again: new text, the end, or one of them left."""
        self.changed.set()
        self.changed = asyncio.Event()

    def typed_by(self, env: RequestEnvelope) -> int | None:
        """How much of the text ``env`` typed (its prompt's extension), or None when it does
        not extend this generation's prompt by text the generation produced, or may not
        follow it (``serves``)."""
        prompt = env.prompt
        if len(prompt) < self.prompt_len or _settings(env) != self.settings:
            return None
        if _digest(prompt[: self.prompt_len]) != self.prompt_hash:
            return None
        typed = prompt[self.prompt_len :]
        if not self.text.startswith(typed):
            return None
        if typed and not _own_run_repeats(env):
            return None
        if self.finish_reason is None and (self.done or self.stopping):
            return None  # cut short (or about to be): its text is not a whole answer
        return len(typed) if self.serves(env, len(typed)) else None

    def serves(self, env: RequestEnvelope, start: int) -> bool:
        """Whether ``env``, having typed ``start`` characters of the text, may follow: it
        gets something, and exactly what its own max_tokens allows."""
        typed_tokens = self.tokens_within(start)
        # Something: a keystroke that typed all the generation made, which makes no more (it
        # ended, or reached its max_tokens), would get an empty answer: the user accepted the
        # whole suggestion and wants a fresh one. (One that ends with no more text while
        # followed leaves it to run on its own: ``workers.followers``.)
        if self.done:
            if start >= len(self.text):
                return False
            if self.finish_reason == "stop":
                # Its natural end: any budget that reaches it gets the whole answer.
                return typed_tokens + env.max_tokens >= self.tokens
        elif start >= len(self.text) and self.tokens >= self.max_tokens:
            return False  # its last delta is in, its end not yet noted
        # Not longer than it may make: stopping at its owner's smaller max_tokens, it would
        # cut the follower short with a 'length' it did not ask for. Not shorter either: an
        # engine may hand several tokens in one delta (vLLM merges outputs, an upstream's
        # chunk may hold several), and where in one the follower's own max_tokens would end is
        # unknown, so its budget must reach the generation's end. With the owner's budget and
        # k tokens typed, it gets up to max_tokens - k: the suggestion as it was asked for.
        return self.max_tokens - typed_tokens <= env.max_tokens <= self.max_tokens


@dataclass(eq=False)
class Follower:
    """A request served from a generation it did not start."""

    env: RequestEnvelope
    generation: Generation
    start: int  # characters of the generation's text it typed itself
    kind: str  # type-through, recent or coalesced
    left: bool = False  # turned stale (or withdrawn): stops at once
    # Its partition went to another worker, which answers it: it reports nothing here.
    withdrawn: bool = False


class ReuseRegistry:
    """The generations of this worker's sessions, running and recent (module docstring)."""

    def __init__(self, *, ttl_s: float = 30.0, max_entries: int = 2000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._by_owner: dict[str, Generation] = {}
        self._by_session: OrderedDict[tuple[str, str], Generation] = OrderedDict()
        self._by_prompt: dict[tuple[str, bytes, Settings], Generation] = {}
        self._followers: dict[str, Follower] = {}

    def __len__(self) -> int:
        return len(self._by_session)

    def begin(self, env: RequestEnvelope) -> Generation:
        """``env`` starts on the engine: its output becomes reusable."""
        generation = Generation(
            owner=env.id,
            team=env.team,
            session=env.session,
            prompt_len=len(env.prompt),
            prompt_hash=_digest(env.prompt),
            settings=_settings(env),
            max_tokens=env.max_tokens,
            streamed=env.stream,
        )
        self._by_owner[env.id] = generation
        self._by_prompt[(env.team, generation.prompt_hash, generation.settings)] = generation
        if env.session is not None:
            key = (env.team, env.session)
            self._by_session[key] = generation
            self._by_session.move_to_end(key)
            self._trim()
        return generation

    def of_owner(self, request_id: str) -> Generation | None:
        return self._by_owner.get(request_id)

    def finished(self, request_id: str) -> None:
        """Its engine request ended: it stays reusable as a recent one (if whole)."""
        generation = self._by_owner.pop(request_id, None)
        if generation is None:
            return
        key = (generation.team, generation.prompt_hash, generation.settings)
        if self._by_prompt.get(key) is generation:
            del self._by_prompt[key]
        if generation.finish_reason is None and generation.session is not None:
            session = (generation.team, generation.session)
            if self._by_session.get(session) is generation:
                del self._by_session[session]

    def match(self, env: RequestEnvelope, now: float | None = None) -> Follower | None:
        """A follower of an existing generation for ``env``, or None: run it on the engine."""
        if not env.reuse or env.messages is not None:
            return None
        now = time.monotonic() if now is None else now
        if env.session is not None:
            generation = self._by_session.get((env.team, env.session))
            if generation is not None:
                if generation.done and now - generation.finished_at > self.ttl_s:
                    del self._by_session[(env.team, env.session)]
                else:
                    start = generation.typed_by(env)
                    if start is not None:
                        kind = "recent" if generation.done else "type-through"
                        return self._follow(env, generation, start, kind)
        running = self._by_prompt.get((env.team, _digest(env.prompt), _settings(env)))
        if (
            running is not None
            and not running.done
            and not running.stopping
            and running.owner != env.id
            and running.serves(env, 0)
        ):
            return self._follow(env, running, 0, "coalesced")
        return None

    def _follow(
        self, env: RequestEnvelope, generation: Generation, start: int, kind: str
    ) -> Follower:
        follower = Follower(env, generation, start, kind)
        generation.followers[env.id] = follower
        self._followers[env.id] = follower
        return follower

    def follower(self, request_id: str) -> Follower | None:
        return self._followers.get(request_id)

    def leave(self, request_id: str) -> Generation | None:
        """A follower is done (finished or stale); returns its generation."""
        follower = self._followers.pop(request_id, None)
        if follower is None:
            return None
        follower.generation.followers.pop(request_id, None)
        return follower.generation

    def expire(self, now: float | None = None) -> None:
        """Forget finished generations past their time to live."""
        now = time.monotonic() if now is None else now
        for key, generation in list(self._by_session.items()):
            if generation.done and now - generation.finished_at > self.ttl_s:
                del self._by_session[key]

    def _trim(self) -> None:
        while len(self._by_session) > self.max_entries:
            self._by_session.popitem(last=False)
