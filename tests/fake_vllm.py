"""An in-memory stand-in for the slice of vLLM's API that ``workers.vllm_engine`` uses.

It lets the default test run (no vLLM, no torch) cover the engine adapter: delta streaming,
abort, priority, prefix-cache accounting and scheduler stats. ``install(monkeypatch)`` puts
it in ``sys.modules`` under vLLM's module names. Shapes follow vLLM 0.32 (``RequestOutput``,
``CompletionOutput``, ``RequestStateStats``, ``SchedulerStats``); the opt-in tests check the
same adapter against the real engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import sys
import time
import types
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import pytest

from tests.vllm_fixtures import recorded_engine_arg_fields

BLOCK_TOKENS = 4


class VLLMError(Exception):
    """vLLM 0.32's ``vllm.exceptions`` family: a request's refusal is a ``VLLMClientError``,
    which is not a ``ValueError``."""


class VLLMClientError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    pass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | None = None
    seed: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclasses.dataclass
class ChatParams:
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def _engine_args_class() -> type:
    """``AsyncEngineArgs`` with exactly the recorded field names (all optional)."""
    fields = [(name, Any, dataclasses.field(default=None)) for name in recorded_engine_arg_fields()]
    return dataclasses.make_dataclass("AsyncEngineArgs", fields)


AsyncEngineArgs = _engine_args_class()


class FakePlatform:
    device_name = "cpu"

    def __init__(self, *, cpu: bool = True, fp8: bool = False) -> None:
        self.cpu = cpu
        self.fp8 = fp8

    def is_cpu(self) -> bool:
        return self.cpu

    def supports_fp8(self) -> bool:
        return self.fp8


class FakeTokenizer:
    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template


class FakeRenderer:
    """Words are tokens; chat is rendered as ``<role> content`` turns."""

    def __init__(self, chat_template: str | None) -> None:
        self.tokenizer = FakeTokenizer(chat_template)
        self.chat_calls: list[tuple[list[dict[str, str]], ChatParams]] = []

    async def render_cmpl_async(self, prompts: list[dict[str, str]]) -> list[dict[str, Any]]:
        return [{"type": "token", "prompt_token_ids": p["prompt"].split()} for p in prompts]

    async def render_chat_async(
        self, conversations: list[list[dict[str, str]]], params: ChatParams
    ) -> tuple[list[Any], list[dict[str, Any]]]:
        self.chat_calls.append((conversations[0], params))
        rendered = [
            [word for m in conv for word in (f"<{m['role']}>", *m["content"].split())]
            + (["<assistant>"] if params.chat_template_kwargs.get("add_generation_prompt") else [])
            for conv in conversations
        ]
        return conversations, [{"type": "token", "prompt_token_ids": r} for r in rendered]


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0


@dataclasses.dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)


@dataclasses.dataclass
class RequestStateStats:
    scheduled_ts: float = 0.0
    last_token_ts: float = 0.0


@dataclasses.dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[str]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestStateStats


class FakeAsyncLLM:
    """Generates ``w0 w1 …`` one word per step of ``step_s``; a prefix cache of 4-token blocks."""

    instances: ClassVar[list[FakeAsyncLLM]] = []
    chat_template: str | None = "{{ messages }}"
    step_s = 0.005
    fail_with: BaseException | None = None
    finish_with: str | None = None
    # Like vLLM while a request is being added: aborts of it are ignored until its first output.
    register_late = False

    def __init__(self, engine_args: Any, stat_loggers: list[Callable[..., Any]]) -> None:
        self.engine_args = engine_args
        self.renderer = FakeRenderer(self.chat_template)
        self.loggers = [factory(None, 0) for factory in stat_loggers]
        self.requests: list[tuple[str, SamplingParams, int]] = []
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.blocks: set[tuple[str, ...]] = set()
        self.shut_down = False
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(
        cls, engine_args: Any, stat_loggers: list[Callable[..., Any]] | None = None
    ) -> FakeAsyncLLM:
        return cls(engine_args, stat_loggers or [])

    def _cached(self, tokens: list[str], salt: str | None) -> tuple[int, int, int]:
        """(cached tokens, queried tokens, hit tokens) for a prompt, then cache its blocks;
        as vLLM, a block is found only by a prompt of the same ``cache_salt``."""
        cached, hitting = 0, True
        for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
            block = (salt, *tokens[:end])
            if hitting and block in self.blocks:
                cached = end
            else:
                hitting = False
            self.blocks.add(block)
        return cached, len(tokens), cached

    def _record(self, queries: int = 0, hits: int = 0) -> None:
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            kv_cache_usage=min(1.0, len(self.blocks) / 100),
            prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits),
        )
        for logger in self.loggers:
            logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)

    async def generate(
        self, prompt: dict[str, Any], params: SamplingParams, request_id: str, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if self.fail_with is not None:
            raise self.fail_with
        assert params.output_kind is RequestOutputKind.DELTA
        self.requests.append((request_id, params, priority))
        tokens: list[str] = prompt["prompt_token_ids"]
        cached, queries, hits = self._cached(tokens, prompt.get("cache_salt"))
        metrics = RequestStateStats(scheduled_ts=time.monotonic())
        if not self.register_late:
            self.running.add(request_id)
        self._record(queries, hits)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if i == 1:
                    self.running.add(request_id)
                metrics.last_token_ts = time.monotonic()
                if request_id in self.aborted:
                    finish: str | None = "abort"
                    out = CompletionOutput("", [], finish)
                else:
                    last = i == params.max_tokens - 1
                    finish = (self.finish_with or "length") if last else None
                    out = CompletionOutput(f"w{i} ", [i], finish)
                yield RequestOutput(request_id, tokens, [out], finish is not None, cached, metrics)
                if finish is not None:
                    return
        finally:
            self.running.discard(request_id)
            self._record()

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        self.aborted.update(i for i in ids if i in self.running)

    def shutdown(self) -> None:
        self.shut_down = True


def install(monkeypatch: pytest.MonkeyPatch, platform: FakePlatform | None = None) -> None:
    """Make ``import vllm…`` (the modules the engine uses) return this fake."""
    FakeAsyncLLM.instances = []
    modules: dict[str, dict[str, Any]] = {
        "vllm": {"SamplingParams": SamplingParams},
        "vllm.sampling_params": {"RequestOutputKind": RequestOutputKind},
        "vllm.engine": {},
        "vllm.exceptions": {
            "VLLMError": VLLMError,
            "VLLMClientError": VLLMClientError,
            "VLLMValidationError": VLLMValidationError,
        },
        "vllm.engine.arg_utils": {"AsyncEngineArgs": AsyncEngineArgs},
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.async_llm": {"AsyncLLM": FakeAsyncLLM},
        "vllm.platforms": {"current_platform": platform or FakePlatform()},
        "vllm.renderers": {},
        "vllm.renderers.params": {"ChatParams": ChatParams},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    # A fresh module object: nothing to restore.
    setattr(sys.modules["vllm"], "sampling_params", sys.modules["vllm.sampling_params"])  # noqa: B010
