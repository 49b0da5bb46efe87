"""What an engine is to a worker: the protocol, its request and its output deltas."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from laneway.schema import ChatMessage
from laneway.tool_frames import ToolPart

__all__ = ["Engine", "EngineDelta", "EngineRequest", "EngineStats"]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    id: str
    route: str
    prompt: str
    max_tokens: int
    messages: list[ChatMessage] | None = None
    # The client set no max_tokens, or the cap or more (``max_tokens`` is its class's cap): an
    # upstream server that refuses the cap as over its context is sent the room it leaves.
    max_tokens_default: bool = False
    suffix: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    priority: int = 0  # lower runs first (vLLM's convention)
    # Epoch seconds by which it must have started (an upstream's first byte), or None.
    deadline_ts: float | None = None

    client_seed: int | None = None  # the client's own ``seed``
    # The ingress's estimate of the prompt (a chat's message framing included): the count
    # when the engine reports none. 0: estimate it from ``prompt``.
    prompt_estimate: int = 0
    # Requests share the engine's cached prefixes only with the same salt (``cache_salt``:
    # the team's, ``workers.cache_salt``); None: with every request.
    cache_salt: str | None = None
    # A chat's function tools and its choice among them (OpenAI's shapes; None: none).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # a chat's JSON output; None: text
    # Sampling fields the client did not set (their values are laneway's defaults).
    unset: frozenset[str] = frozenset()

    @property
    def seed(self) -> int:
        """The client's seed, else one of its own that is the same on every run: a re-run
        after a worker crash repeats the text a client already has (engines that honour
        seeds do)."""
        if self.client_seed is not None:
            return self.client_seed
        return int.from_bytes(hashlib.blake2b(self.id.encode(), digest_size=4).digest(), "big")


@dataclass(frozen=True, slots=True)
class EngineDelta:
    """New text since the previous delta plus running totals for the request."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine_ms: float
    finish_reason: str | None = None
    # When the step that made it ended (time.monotonic()), for an engine that knows: it may
    # be earlier than when the worker reads the delta. None: take the time it was read.
    ended: float | None = None
    # The parts of a chat's tool calls that came with this delta, as the server sent them.
    tool_parts: tuple[ToolPart, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    memory_free_bytes: int | None = None


class Engine(Protocol):
    """An inference engine: many ``generate`` calls run at once on one engine."""

    name: str
    is_simulation: bool

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        """Stream deltas; the last one has ``finish_reason``. Raises ``EngineError``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request within one decode step (``Aborted`` in its generator)."""
        ...

    def stats(self) -> EngineStats: ...

    def capacity(self) -> int:
        """Requests it can start at once now; the worker hands it no more and keeps the rest
        in its own queue, where the shield can still drop them."""
        ...

    def watch_capacity(self, on_room: Callable[[], None]) -> None:
        """Call ``on_room`` when ``capacity()`` may have risen with no request ending."""
        ...

    def model_digest(self) -> str:
        """Digest of the served model's config and weight manifest (integrity check)."""
        ...
