"""The sim engine: a calibrated GPU performance model that stands in where there is no GPU.

It is a simulation and says so (``is_simulation``). Costs are modelled, not measured:
prefill costs ``prefill_ms_per_token`` for each token not found in the prefix cache, each
decode step costs ``decode_ms_per_step``, at most ``batch_slots`` sequences decode at once
(the rest wait, as in a full continuous batch), every running sequence gets its token of a
step at the same moment (one batch step for all, a new one joining at the next step), and
the prefix cache is an LRU of ``block_tokens``-token blocks keyed by the hash of everything
before them. Text is deterministic: the same prompt yields the same completion, so a re-run
after a crash repeats what the client already saw. A stop sequence ends it as an engine's
would: left out of the text, ``finish_reason`` ``stop``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from laneway.errors import Aborted, EngineError, EngineUnsupported
from laneway.tokens import CHARS_PER_TOKEN
from workers.types import EngineDelta, EngineRequest, EngineStats

__all__ = ["SimEngine", "SimProfile"]

_WORDS = (
    "return",
    "self",
    "value",
    "result",
    "data",
    "items",
    "index",
    "name",
    "config",
    "node",
    "token",
    "buffer",
    "cache",
    "key",
    "request",
    "stream",
    "offset",
    "count",
    "total",
    "error",
)


@dataclass(frozen=True, slots=True)
class SimProfile:
    prefill_ms_per_token: float = 0.05
    decode_ms_per_step: float = 15.0
    batch_slots: int = 32
    prefix_cache_blocks: int = 4096
    kv_tokens: int = 0  # KV memory of running sequences, in tokens (0: not modelled)
    block_tokens: int = 16
    failure_rate: float = 0.0
    route_failure_rates: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0


def _tokens(text: str) -> list[str]:
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def _cut_at_stop(words: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """The steps' texts up to the first stop sequence, as an engine streams them: the stop
    sequence is left out, and so is whatever came after it; the step that completed it
    still counts as a generated token (its text may be empty). ``True`` when one stopped."""
    text = "".join(words)
    ends = list(itertools.accumulate(len(word) for word in words))  # text length per step
    # vLLM checks the stops after each step, in the order given: the first step to complete
    # one ends the text, and of those it completes, the first listed.
    found = [
        (bisect.bisect_left(ends, at + len(stop)), order, at)
        for order, stop in enumerate(stops)
        if stop and (at := text.find(stop)) >= 0
    ]
    if not found:
        return words, False
    step, _, cut = min(found)
    kept = [word[: max(0, cut - (end - len(word)))] for word, end in zip(words, ends, strict=True)]
    return kept[: step + 1], True


class SimEngine:
    """Simulated GPU engine (see module docstring)."""

    name = "sim"
    is_simulation = True

    def __init__(self, profile: SimProfile | None = None) -> None:
        self.profile = profile or SimProfile()
        self._slots = asyncio.Semaphore(self.profile.batch_slots)
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._aborted: dict[str, float] = {}  # request id: when the abort came (monotonic)
        self._running = 0
        self._waiting = 0
        self._queries = 0
        self._hits = 0
        self._rng = random.Random(self.profile.seed)
        self._kv_used = 0
        self._kv_held = 0.0  # share of KV memory held outside its requests (hold_kv)
        self._epoch = time.monotonic()  # step boundaries fall at _epoch + k × step

    def _next_step(self, now: float, step_s: float) -> float:
        """The first step boundary at or after ``now``: where a sequence joins the batch."""
        return self._epoch + math.ceil((now - self._epoch) / step_s) * step_s

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._aborted.clear()

    async def abort(self, request_id: str) -> None:
        self._aborted.setdefault(request_id, time.monotonic())

    def capacity(self) -> int:
        return self.profile.batch_slots

    def watch_capacity(self, on_room: Callable[[], None]) -> None:
        return None  # its batch slots never change

    def hold_kv(self, share: float) -> None:
        """Simulate ``share`` (0..1) of the KV memory taken by something other than this
        engine's requests (another model, fragmentation, a leak): a drill's way to hold the
        engine under memory pressure (``laneway drill memory``)."""
        self._kv_held = min(1.0, max(0.0, share))

    def stats(self) -> EngineStats:
        # KV usage is memory held by running sequences. Cached blocks no sequence holds are
        # evictable, so a full prefix cache is not memory pressure (vLLM counts them as free
        # too); with unlimited KV memory (kv_tokens=0) only a simulated hold is reported.
        kv_tokens = self.profile.kv_tokens
        free: int | None = None
        usage = self._kv_held
        if kv_tokens:
            usage = min(1.0, usage + self._kv_used / kv_tokens)
            free = max(0, int(kv_tokens * (1 - self._kv_held)) - self._kv_used)
        return EngineStats(
            running=self._running,
            waiting=self._waiting,
            kv_cache_usage=usage,
            memory_free_bytes=free,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def model_digest(self) -> str:
        """The simulation has no weights: its digest is that of its cost profile."""
        return hashlib.sha256(f"sim:{self.profile!r}".encode()).hexdigest()[:16]

    def _cached_tokens(self, tokens: list[str], salt: str | None = None) -> int:
        """Longest cached prefix in whole blocks; every full block is then cached (LRU).
        Blocks are shared only between requests of the same ``salt`` (vLLM's
        ``cache_salt``: its first block's hash covers it)."""
        size = self.profile.block_tokens
        capacity = self.profile.prefix_cache_blocks
        digest = hashlib.blake2b(digest_size=16)
        if salt is not None:
            digest.update(b"salt\0" + salt.encode() + b"\0")
        hit_blocks = 0
        still_hitting = True
        for start in range(0, len(tokens) - size + 1, size):
            digest.update("".join(tokens[start : start + size]).encode())
            block = digest.digest()
            self._queries += 1
            if still_hitting and block in self._cache:
                self._hits += 1
                hit_blocks += 1
                self._cache.move_to_end(block)
                continue
            still_hitting = False
            if capacity:
                self._cache[block] = None
                if len(self._cache) > capacity:
                    self._cache.popitem(last=False)
        return hit_blocks * size

    def _completion_words(self, request: EngineRequest) -> list[str]:
        seed = hashlib.sha256(f"{request.route}\0{request.prompt}".encode()).digest()
        rng = random.Random(seed)
        length = min(request.max_tokens, 4 + seed[0] % max(1, request.max_tokens))
        return [rng.choice(_WORDS) + " " for _ in range(length)]

    async def _sleep_ms(self, ms: float, step: int = 0) -> None:
        if ms > 0:
            await asyncio.sleep(ms / 1000)
        elif step % 32 == 0:
            # An instant engine still lets the loop breathe now and then, not at every token.
            await asyncio.sleep(0)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if request.response_format is not None:
            raise EngineUnsupported(
                "response_format is not kept by the simulated engine (it writes made-up words, "
                "no JSON); put an OpenAI-compatible server behind laneway (LANEWAY_UPSTREAM_URL)",
                param="response_format",
            )
        if request.tools and request.tool_choice != "none":
            # A simulation writes words: it calls no tool. Unsupported, as for any engine
            # without what a request asks: a 400, its team neither charged nor isolated.
            raise EngineUnsupported(
                "tools are not called by the simulated engine (it writes made-up text); put "
                "an OpenAI-compatible server that calls them behind laneway "
                "(LANEWAY_UPSTREAM_URL), or send tool_choice 'none'",
                param="tools",
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            # aclosing: a consumer that stops early (cancelled, closed) frees the slot and
            # the KV at once, not whenever the inner generators are collected.
            async with contextlib.aclosing(self._run(request)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._running -= 1
            self._slots.release()
            self._aborted.pop(request.id, None)

    async def _run(self, request: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        profile = self.profile
        if request.id in self._aborted:
            raise Aborted(f"request {request.id} aborted while waiting for a batch slot")
        tokens = _tokens(request.prompt + (request.suffix or ""))
        cached = self._cached_tokens(tokens, request.cache_salt)
        prefill_ms = (len(tokens) - cached) * profile.prefill_ms_per_token
        await self._sleep_ms(prefill_ms)
        engine_ms = prefill_ms
        failure_rate = profile.route_failure_rates.get(request.route, profile.failure_rate)
        if failure_rate and self._rng.random() < failure_rate:
            raise EngineError(f"sim: injected failure ({failure_rate:.0%} of {request.route})")
        words, stopped = _cut_at_stop(self._completion_words(request), request.stop)
        held = len(tokens)
        self._kv_used += held
        try:
            decode = self._decode(request, words, len(tokens), cached, engine_ms, stopped=stopped)
            async with contextlib.aclosing(decode) as deltas:
                async for delta in deltas:
                    self._kv_used += 1
                    held += 1
                    yield delta
        finally:
            self._kv_used -= held

    async def _decode(
        self,
        request: EngineRequest,
        words: list[str],
        prompt: int,
        cached: int,
        engine_ms: float,
        *,
        stopped: bool,
    ) -> AsyncGenerator[EngineDelta, None]:
        profile = self.profile
        step_s = profile.decode_ms_per_step / 1000
        # Steps run on the engine's own clock: a GPU does not wait for the worker to write out
        # the previous token. A consumer that falls behind finds the next steps already done;
        # each delta says when its step ended (``due``), however late it is read. All running
        # sequences share the step boundaries, as they share the steps of a continuous batch.
        began = due = self._next_step(time.monotonic(), step_s) if step_s > 0 else time.monotonic()
        # Waiting to join the batch costs no engine time, and an abort meanwhile costs none.
        await asyncio.sleep(max(0.0, began - time.monotonic()))
        for i, word in enumerate(words):
            if (aborted_at := self._aborted.get(request.id)) is not None:
                # An abort takes effect between steps: the step under way when it came runs
                # to its end, as do any the consumer had not asked for yet.
                if step_s > 0 and aborted_at >= began:
                    begun = int((aborted_at - began) / step_s) + 1
                    steps = min(len(words), max(i, begun))
                    await asyncio.sleep(max(0.0, began + steps * step_s - time.monotonic()))
                    engine_ms += (steps - i) * profile.decode_ms_per_step
                raise Aborted(f"request {request.id} aborted after {i} tokens", engine_ms=engine_ms)
            if step_s > 0:
                due += step_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await self._sleep_ms(0, i)
            engine_ms += profile.decode_ms_per_step
            last = i == len(words) - 1
            length = len(words) == request.max_tokens and not stopped
            finish = ("length" if length else "stop") if last else None
            yield EngineDelta(
                text=word,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=i + 1,
                engine_ms=engine_ms,
                finish_reason=finish,
                ended=due if step_s > 0 else None,
            )
