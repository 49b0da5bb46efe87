"""The ``openai`` engine: any OpenAI-compatible server (vLLM serve, SGLang, llama.cpp, TGI).

Requests stream over HTTP. An abort takes effect at once: the request's connection is
closed whether it waits for its response, for its first byte or between tokens, and every
such server cancels a request whose connection closed (vLLM's own queue included). The
worker hands the server only what it can start (``capacity``): ``LANEWAY_UPSTREAM_SLOTS``
when set, else learned (``workers.learned_slots``), helped by the server's own queue length
where it publishes one (vLLM's ``/metrics``), where its KV-cache usage is read too (memory
pressure, ``workers.memory``).

Engine time is honest about what laneway can see: it runs from the upstream's first byte
(the request started there) to its last chunk. Time before that is the upstream's own
queue and prefill; laneway's dispatch queue is ``queue_ms`` in the usage event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from laneway.errors import (
    Aborted,
    EngineError,
    EngineRejected,
    EngineUnsupported,
    Expired,
    PromptTooLarge,
)
from laneway.tokens import estimate_tokens
from workers.integrity import model_digest
from workers.learned_slots import LearnedSlots
from workers.types import EngineDelta, EngineRequest, EngineStats

__all__ = ["OpenAICompatibleEngine"]

log = logging.getLogger(__name__)

# The queue length that vLLM and SGLang publish on /metrics.
_WAITING = re.compile(
    rb"^(?:vllm:num_requests_waiting|sglang:num_queue_reqs)(?:\{[^}]*\})? (\S+)", re.M
)
# Their KV-cache usage, a share 0..1 (vLLM's V1 and V0 names, SGLang's), for memory pressure.
_KV_USAGE = re.compile(
    rb"^(?:vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc|sglang:token_usage)"
    rb"(?:\{[^}]*\})? (\S+)",
    re.M,
)


@dataclass(slots=True)
class _Call:
    """One request on the upstream, for ``abort`` to close."""

    headers: asyncio.Future[aiohttp.ClientResponse] | None = None
    response: aiohttp.ClientResponse | None = None
    aborted: bool = False
    expired: bool = False  # no first byte by the request's deadline: it never started
    timer: asyncio.TimerHandle | None = None

    def dropped(self, request_id: str, engine_ms: float) -> Aborted | Expired:
        if self.expired:
            return Expired(f"request {request_id}: no first byte from the upstream by its deadline")
        return Aborted(f"request {request_id} aborted upstream", engine_ms=engine_ms)


class OpenAICompatibleEngine:
    name = "openai"
    is_simulation = False

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str = "",
        model: str = "",
        slots: int = 0,
        metrics_url: str = "",
        metrics_interval_s: float = 1.0,
        read_timeout_s: float = 120.0,
        priority: bool = False,
        learned: LearnedSlots | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.slots = slots  # 0: learned
        self.learned = learned or LearnedSlots()
        self.metrics_url = metrics_url
        self.metrics_interval_s = metrics_interval_s
        self.priority = priority  # send each request's priority (vLLM's priority scheduling)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._calls: dict[str, _Call] = {}
        # Aborts of requests whose generate has not begun, by id: when they came (monotonic).
        # Forgotten after _EARLY_ABORT_S: an abort for a request that never came here (it
        # finished, or another worker runs it) must not stop a later run of the same id.
        self._early_aborts: dict[str, float] = {}
        self._upstream_waiting = 0
        self._kv_usage = 0.0  # the upstream's, where its metrics say
        self._metrics_at = -math.inf  # monotonic time of the last reading of them
        self._poller: asyncio.Task[None] | None = None
        self._on_room: Callable[[], None] | None = None
        self._odd_finishes: set[str] = set()  # finish reasons not OpenAI's, logged once each

    async def start(self) -> None:
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            headers=self._headers,
            # No pool limit: the dispatcher bounds what is in flight. A closed (aborted)
            # connection is simply not reused.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=self._read_timeout_s),
            json_serialize=lambda value: orjson.dumps(value).decode(),
        )
        if self.metrics_url:
            self._poller = asyncio.create_task(self._poll_metrics(), name="upstream-metrics")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def capacity(self) -> int:
        return self.slots or self.learned.capacity()

    def watch_capacity(self, on_room: Callable[[], None]) -> None:
        self._on_room = on_room

    async def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is None:
            now = time.monotonic()
            self._early_aborts[request_id] = now
            for rid, at in list(self._early_aborts.items()):
                if now - at > _EARLY_ABORT_S:
                    del self._early_aborts[rid]
            return
        _close(call)

    def stats(self) -> EngineStats:
        # running: ours on the upstream; waiting and KV usage: the upstream's own, where its
        # metrics say (other clients' work included: it is the server's memory). A reading
        # gone stale (its metrics unreadable since, or no longer published) says nothing:
        # kept, a queue or a pressure seen once would hold work back for good.
        if time.monotonic() - self._metrics_at > _STALE_READINGS * self.metrics_interval_s:
            return EngineStats(running=len(self._calls))
        return EngineStats(
            running=len(self._calls),
            waiting=self._upstream_waiting,
            kv_cache_usage=self._kv_usage,
        )

    def model_digest(self) -> str:
        # The weights live upstream: the digest pins which server and model name we use.
        return model_digest(f"{self.base_url}#{self.model}")

    def _body(self, request: EngineRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model or request.route,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": request.seed,
        }
        if request.stop:
            body["stop"] = request.stop
        if self.priority:
            body["priority"] = request.priority
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.messages is not None:
            body["messages"] = [m.model_dump() for m in request.messages]
            return "/chat/completions", body
        body["prompt"] = request.prompt
        if request.suffix:
            # An empty one (the cursor at the end of the file) asks for a plain continuation,
            # and is not sent: vLLM serve refuses a `suffix` of any value, "" included.
            body["suffix"] = request.suffix
        return "/completions", body

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._session is None:
            raise EngineError("openai engine is not started (or already stopped)")
        path, body = self._body(request)
        # An upstream that reports no usage is billed the ingress's estimate, a chat's
        # framing included; the text's own estimate is for requests that carry none.
        estimate = request.prompt_estimate or estimate_tokens(request.prompt)
        call = self._open(request, estimate)
        reading = _Reading(estimate)
        try:
            if call.aborted:
                raise Aborted(f"request {request.id} aborted before it was sent")
            response = await self._send(call, request.id, path, body)
            if response.content_type != "text/event-stream":
                raise EngineError(
                    f"upstream {self.base_url}{path} answered {response.content_type or 'a body'}"
                    ", not the event stream it was asked for"
                )
            async for line in response.content:
                if call.aborted:  # between two lines: _close closed the response
                    response.close()
                    break
                if reading.started is None:
                    self._began(request.id, call, reading)
                delta = reading.line(line)
                if delta is not None:
                    yield delta
                elif reading.done:
                    break
            if call.aborted:
                raise call.dropped(request.id, reading.ms())
            chat = request.messages is not None
            yield reading.final(self._openai_finish(reading.finish, chat=chat))
        except (aiohttp.ClientError, TimeoutError) as exc:
            if call.aborted:
                raise call.dropped(request.id, reading.ms()) from None
            raise EngineError(f"upstream {self.base_url}{path}: {exc!r}") from exc
        finally:
            self._end(request.id, call)

    def _open(self, request: EngineRequest, prompt_tokens: int) -> _Call:
        call = _Call()
        self._calls[request.id] = call
        if self._early_aborts.pop(request.id, None) is not None:
            call.aborted = True
        self.learned.sent(request.id, prompt_tokens)
        if request.deadline_ts is not None:
            # Not started upstream by its deadline (queued there, or the upstream hangs): it
            # is dropped as expired, as it would be in laneway's own queue.
            call.timer = asyncio.get_running_loop().call_later(
                max(0.0, request.deadline_ts - time.time()), _expire, call
            )
        return call

    def _began(self, request_id: str, call: _Call, reading: _Reading) -> None:
        """The upstream's first byte: the request started there."""
        reading.started = time.perf_counter()
        if call.timer is not None:
            call.timer.cancel()
        self.learned.first_byte(request_id)
        self._room()

    def _end(self, request_id: str, call: _Call) -> None:
        if call.timer is not None:
            call.timer.cancel()
        if call.response is not None:
            # Read to its end, the connection is kept for the next request; else closed.
            call.response.release()
        del self._calls[request_id]
        self.learned.done(request_id)
        self._room()

    async def _send(
        self, call: _Call, request_id: str, path: str, body: dict[str, Any]
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers; an abort meanwhile closes the connection."""
        session = self._session
        if session is None:
            raise EngineError("openai engine is not started (or already stopped)")

        async def post() -> aiohttp.ClientResponse:
            return await session.post(self.base_url + path, data=orjson.dumps(body), headers=_JSON)

        call.headers = asyncio.ensure_future(post())
        try:
            response = call.response = await call.headers
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if call.aborted and (current is None or not current.cancelling()):
                raise call.dropped(request_id, 0.0) from None
            call.headers.cancel()
            raise
        finally:
            call.headers = None
        if call.aborted:
            # Aborted once the headers came, before this task took them (vLLM sends a
            # stream's headers at once): _close found no response to close and the wait for
            # the headers over. Closed now, not at the first token: the upstream would run the
            # whole prefill of a request no one wants.
            response.close()
            raise call.dropped(request_id, 0.0)
        if response.status != 200:
            detail = (await response.read())[:300].decode(errors="replace")
            if response.status in _REQUEST_REFUSED:
                # The upstream refused the request itself (a prompt over its context,
                # parameters it does not take): the client's doing, not a route fault for
                # the breaker; the upstream's reason goes back to the client, its address not.
                raise _refusal(_reason(detail))
            raise EngineError(f"upstream {self.base_url}{path}: {response.status} {detail}")
        return response

    def _openai_finish(self, reason: object, *, chat: bool) -> str:
        """The upstream's finish_reason as OpenAI's (clients and their SDKs check the value).
        An abort of the upstream's own (SGLang's ``abort``: the text is not a whole answer)
        or a value OpenAI does not have fails the request; the value is logged once."""
        if reason is None:
            return "stop"  # ended by [DONE] alone
        openai = _CHAT_FINISH_REASONS if chat else _FINISH_REASONS
        if isinstance(reason, str) and reason in openai:
            return openai[reason]
        said = repr(reason)[:60]
        if said not in self._odd_finishes and len(self._odd_finishes) < _ODD_FINISHES_LOGGED:
            self._odd_finishes.add(said)
            log.warning(
                "upstream %s ended a %s request with finish_reason %s, which is not one of "
                "OpenAI's: such requests fail as engine errors (logged once for this value)",
                self.base_url,
                "chat" if chat else "completion",
                said,
            )
        if reason == "abort":
            raise EngineError(f"the upstream aborted the request itself (finish_reason {said})")
        raise EngineError(f"the upstream ended the request with finish_reason {said}, not OpenAI's")

    def _room(self) -> None:
        if self._on_room is not None:
            self._on_room()

    async def _poll_metrics(self) -> None:
        """The upstream's own queue length and KV-cache usage, every ``metrics_interval_s``."""
        assert self._session is not None
        while True:
            try:
                async with self._session.get(self.metrics_url) as response:
                    text = await response.read()
                    status = response.status
                waiting = _WAITING.search(text)
                kv_usage = _KV_USAGE.search(text)
                if status == 404 or (status == 200 and waiting is None and kv_usage is None):
                    log.info(
                        "upstream publishes no queue length or KV-cache usage at %s; its "
                        "capacity is learned from first-byte times alone, and its memory "
                        "pressure is not seen",
                        self.metrics_url,
                    )
                    return
                if waiting is not None:
                    self._upstream_waiting = int(float(waiting.group(1)))
                    self.learned.upstream_load(
                        self._upstream_waiting, fresh_s=3 * self.metrics_interval_s
                    )
                if kv_usage is not None:
                    self._kv_usage = min(1.0, max(0.0, float(kv_usage.group(1))))
                if waiting is not None or kv_usage is not None:
                    self._metrics_at = time.monotonic()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("upstream metrics at %s unreadable: %s", self.metrics_url, exc)
            await asyncio.sleep(self.metrics_interval_s)


_JSON = {"content-type": "application/json"}
# An abort waits at most this long for its request's generate to begin.
_EARLY_ABORT_S = 5.0
# The upstream's metrics are read every metrics_interval_s; missed this many times in a row,
# what they last said no longer counts.
_STALE_READINGS = 3
# What servers end a stream with, as OpenAI's finish_reason. TGI tells the model's own end
# of text (eos_token) from a stop string (stop_sequence); OpenAI calls both ``stop``. A chat
# may end in tool calls; a completion cannot.
_FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "content_filter": "content_filter",
    "eos_token": "stop",
    "stop_sequence": "stop",
}
_CHAT_FINISH_REASONS = {**_FINISH_REASONS, "tool_calls": "tool_calls"}
# A server sending a new value with every request would otherwise fill the log (and memory).
_ODD_FINISHES_LOGGED = 32
# Statuses by which OpenAI-compatible servers (vLLM, SGLang, llama.cpp, TGI) refuse a request
# for what it asks: bad request, too large, unprocessable.
_REQUEST_REFUSED = frozenset({400, 413, 422})


def _reason(detail: str) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message"}}`` or vLLM's
    ``{"message"}``), else the body's first 200 characters."""
    try:
        body = orjson.loads(detail)
    except orjson.JSONDecodeError:
        return detail[:200]
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if message is None and isinstance(body, dict):
        message = body.get("message")
    return str(message)[:200] if message else detail[:200]


def _refusal(reason: str) -> EngineRejected:
    """The upstream's refusal of a request for what it asks, with the upstream's reason: a
    parameter the server does not have at all (in its known words) is unsupported."""
    message = f"the engine refused the request: {reason}"
    return EngineUnsupported.from_engine(message) or EngineRejected(message)


def _stream_error(chunk: dict[str, Any], *, text_sent: bool) -> EngineError:
    """An error event in a stream. Before any text, a refusal of the request for what it
    asks is a refusal (TGI, and older SGLang and llama.cpp, refuse in a 200 stream): its
    error type says validation, its status is one of ``_REQUEST_REFUSED``, or it says the
    prompt is over the context in a known server's words. Anything else, or anything after
    text, is a failure midway (vLLM ends a request that failed while running so)."""
    error = chunk["error"]
    fields: dict[str, Any] = error if isinstance(error, dict) else {}
    said = str(fields.get("message", error) if fields else error)[:300]
    refused_status = fields.get("type") != _ANY_FAILURE_TYPE and any(
        _status(fields.get(name)) in _REQUEST_REFUSED for name in _STATUS_FIELDS
    )
    if not text_sent and (
        "validation" in (chunk.get("error_type"), fields.get("error_type"))
        or refused_status
        or PromptTooLarge.from_engine(said, param=None) is not None
    ):
        return _refusal(said)
    return EngineError(f"the upstream failed midway: {said}")


# Where servers put an HTTP status in a stream's error event: llama.cpp's and SGLang's
# ``code``, older SGLang's ``http_status_code``, others' ``status``.
_STATUS_FIELDS = ("code", "http_status_code", "status")
# vLLM serve's stream generators answer any exception with this type and code 400, a dead
# engine's included (newer versions say 500 for those): its status tells no refusal apart.
_ANY_FAILURE_TYPE = "BadRequestError"


def _status(value: object) -> int | None:
    """An HTTP status given as a number or a string of digits (not a code like "invalid")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _expire(call: _Call) -> None:
    call.expired = True
    _close(call)


def _close(call: _Call) -> None:
    """Stop a request now: its connection closes, which the upstream reads as a cancel."""
    call.aborted = True
    if call.response is not None:
        call.response.close()
    elif call.headers is not None:
        call.headers.cancel()


class _Reading:
    """Totals of one streamed response, folded in chunk by chunk."""

    __slots__ = (
        "cached",
        "completion_tokens",
        "done",
        "finish",
        "prompt_tokens",
        "started",
        "text_sent",
    )

    def __init__(self, prompt_tokens: int) -> None:
        self.done = False  # [DONE] was read
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached = 0
        self.finish: object = None  # the server's own value, until _openai_finish reads it
        self.started: float | None = None  # perf_counter at the first byte
        self.text_sent = False  # some text came (and went on to the client)

    def ms(self) -> float:
        return 0.0 if self.started is None else (time.perf_counter() - self.started) * 1000

    def line(self, line: bytes) -> EngineDelta | None:
        """One line of the event stream: the delta it brings, if any."""
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return None
        try:
            chunk = orjson.loads(data)
            if isinstance(chunk, dict) and chunk.get("error"):
                # vLLM and others end a stream that failed midway with an error event (and
                # then [DONE]): the answer so far is not a whole one. TGI refuses a request
                # so too, before any text.
                raise _stream_error(chunk, text_sent=self.text_sent)
            return self.chunk(chunk)
        except (ValueError, TypeError, AttributeError) as exc:
            # Not the OpenAI chunk it must be: the request fails with an engine error (its
            # client answered, its quota settled, the route's breaker told), never silently.
            raise EngineError(
                f"the upstream sent an event that is not an OpenAI chunk: {bytes(data[:120])!r}"
            ) from exc

    def chunk(self, chunk: dict[str, Any]) -> EngineDelta | None:
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            self.cached = int(details.get("cached_tokens") or 0)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        text = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text += (delta.get("content") if delta else choice.get("text")) or ""
            self.finish = choice.get("finish_reason") or self.finish
        if text and not usage:
            self.completion_tokens += 1
        self.text_sent = self.text_sent or bool(text)
        if not (text or usage):
            return None
        return EngineDelta(
            text=text,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached,
            completion_tokens=self.completion_tokens,
            engine_ms=self.ms(),
        )

    def final(self, finish_reason: str) -> EngineDelta:
        """The end, with OpenAI's ``finish_reason``: raises when the stream stopped before
        saying it was done ([DONE], or a finish_reason), as a connection the upstream dropped
        or a body cut short does; the text so far is not a whole answer then."""
        if not self.done and self.finish is None:
            raise EngineError(
                "the upstream's stream ended before its end (no finish_reason, no [DONE])"
            )
        return EngineDelta(
            text="",
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached,
            completion_tokens=self.completion_tokens,
            engine_ms=self.ms(),
            finish_reason=finish_reason,
        )
