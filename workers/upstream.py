"""The ``openai`` engine: any OpenAI-compatible server (vLLM serve, SGLang, llama.cpp, TGI).

Requests stream over HTTP (read by ``workers.upstream_stream``). An abort takes effect at
once: the request's connection is closed whether it waits for its response, for its first
byte or between tokens, and every such server cancels a request whose connection closed
(vLLM's own queue included; ``workers.upstream_calls``). The worker hands the server only
what it can start (``capacity``): ``LANEWAY_UPSTREAM_SLOTS`` when set, else learned
(``workers.learned_slots``), helped by the server's own queue length where it publishes one
(vLLM's ``/metrics``, ``workers.upstream_metrics``), where its KV-cache usage is read too
(memory pressure, ``workers.memory``).

Engine time is honest about what laneway can see: it runs from the upstream's first byte
(the request started there) to its last chunk. Time before that is the upstream's own
queue and prefill; laneway's dispatch queue is ``queue_ms`` in the usage event.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

from laneway.errors import Aborted, EngineError, EngineFull, EngineUnsupported
from laneway.schema import ChatMessage
from laneway.tokens import estimate_tokens
from workers.integrity import model_digest
from workers.learned_slots import LearnedSlots
from workers.types import EngineDelta, EngineRequest, EngineStats
from workers.upstream_calls import UpstreamCall
from workers.upstream_metrics import UpstreamMetrics
from workers.upstream_refusals import (
    REQUEST_REFUSED,
    OverContext,
    context_room,
    error_reason,
    refusal,
)
from workers.upstream_stream import FinishReasons, StreamReading, TokensPerChunk

__all__ = ["OpenAICompatibleEngine"]


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
        self._calls: dict[str, UpstreamCall] = {}
        # Aborts of requests whose generate has not begun, by id: when they came (monotonic).
        # Forgotten after _EARLY_ABORT_S: an abort for a request that never came here (it
        # finished, or another worker runs it) must not stop a later run of the same id.
        self._early_aborts: dict[str, float] = {}
        self._metrics = UpstreamMetrics(metrics_url, metrics_interval_s, self.learned)
        self._poller: asyncio.Task[None] | None = None
        self._on_room: Callable[[], None] | None = None
        self._finishes = FinishReasons(self.base_url)
        # The upstream sends its usage in a chunk of its own after the finish_reason (vLLM
        # does, late under load): a stream is then read on after its finish to its end.
        self._usage_follows = False
        self._per_chunk = TokensPerChunk()  # what a stream ended before its usage is billed
        # When a request of ours last had its first byte (monotonic; from the start).
        self._answered_at = time.monotonic()
        # Requests the upstream refused for want of room, by id: since when (monotonic).
        self._refused_since: dict[str, float] = {}

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
            self._poller = asyncio.create_task(
                self._metrics.poll(self._session), name="upstream-metrics"
            )

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
        call.close()

    def stats(self) -> EngineStats:
        # running: ours on the upstream; waiting and KV usage: the upstream's own, where its
        # metrics say (other clients' work included: it is the server's memory). A reading
        # gone stale (its metrics unreadable since, or no longer published) says nothing:
        # kept, a queue or a pressure seen once would hold work back for good.
        metrics = self._metrics
        if time.monotonic() - metrics.at > metrics.stale_after_s:
            return EngineStats(running=len(self._calls))
        return EngineStats(
            running=len(self._calls),
            waiting=metrics.waiting,
            kv_cache_usage=metrics.kv_usage,
        )

    def model_digest(self) -> str:
        # The weights live upstream: the digest pins which server and model name we use.
        return model_digest(f"{self.base_url}#{self.model}")

    def _body(self, request: EngineRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model or request.route,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": request.seed,
        }
        # As the client set them: one that set none leaves them to the server's defaults
        # (vLLM's are its model's generation config), as it would straight to the server.
        if "temperature" not in request.unset:
            body["temperature"] = request.temperature
        if "top_p" not in request.unset:
            body["top_p"] = request.top_p
        if request.stop:
            body["stop"] = request.stop
        # Only when asked: a server without them (TGI's completions) takes a request without.
        if request.presence_penalty:
            body["presence_penalty"] = request.presence_penalty
        if request.frequency_penalty:
            body["frequency_penalty"] = request.frequency_penalty
        if self.priority:
            body["priority"] = request.priority
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.messages is not None:
            return "/chat/completions", {**body, **_chat_fields(request, request.messages)}
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
        reading = StreamReading(estimate, request.max_tokens, self._per_chunk.value)
        try:
            if call.aborted:
                raise Aborted(f"request {request.id} aborted before it was sent")
            response = await self._start(call, request, path, body, reading)
            if response.content_type != "text/event-stream":
                raise EngineError(
                    f"upstream {self.base_url}{path} answered {response.content_type or 'a body'}"
                    ", not the event stream it was asked for"
                )
            while line := await _next_line(
                response, finished=reading.finish is not None and not self._usage_follows
            ):
                if call.aborted:  # between two lines: its close closed the response
                    response.close()
                    break
                if reading.started is None:
                    self._began(request.id, call, reading, line)
                delta = reading.line(line)
                if delta is not None:
                    yield delta
                elif reading.done or reading.over:
                    # Over max_tokens, not read to its end: its release closes it, and the
                    # upstream stops the request there too.
                    break
            self._usage_follows = self._usage_follows or reading.usage_after_finish
            if call.aborted:
                raise call.dropped(request.id, reading.ms())
            chat = request.messages is not None
            final = reading.final(self._finishes.openai(reading.finish, chat=chat))
            self._per_chunk.learn(reading)
            yield final
        except (aiohttp.ClientError, TimeoutError) as exc:
            if call.aborted:
                raise call.dropped(request.id, reading.ms()) from None
            raise EngineError(f"upstream {self.base_url}{path}: {exc!r}") from exc
        finally:
            self._end(request.id, call)

    async def _start(
        self,
        call: UpstreamCall,
        request: EngineRequest,
        path: str,
        body: dict[str, Any],
        reading: StreamReading,
    ) -> aiohttp.ClientResponse:
        """``_send``, and once more for a chat that set no length and was refused as over
        the server's context with laneway's cap: sent the room the context leaves its
        prompt, as the server itself gives a chat that sets none (its default), instead of
        a refusal the client caused nowhere."""
        try:
            return await self._send(call, request.id, path, body)
        except OverContext as refused:
            if not request.max_tokens_default or refused.room >= body["max_tokens"]:
                raise
            body["max_tokens"] = reading.max_tokens = refused.room
            if call.aborted:
                raise call.dropped(request.id, 0.0) from None
            # The refused response is read and done: an abort from here on must close the
            # second POST (``UpstreamCall.close`` closes a response, else the headers' wait).
            call.response = None
            self.learned.resent(request.id)
            return await self._send(call, request.id, path, body)

    def _open(self, request: EngineRequest, prompt_tokens: int) -> UpstreamCall:
        call = UpstreamCall()
        self._calls[request.id] = call
        if self._early_aborts.pop(request.id, None) is not None:
            call.aborted = True
        self.learned.sent(request.id, prompt_tokens)
        if request.deadline_ts is not None:
            # Not started upstream by its deadline (queued there, or the upstream hangs): it
            # is dropped as expired, as it would be in laneway's own queue.
            call.timer = asyncio.get_running_loop().call_later(
                max(0.0, request.deadline_ts - time.time()), call.expire
            )
        return call

    def _began(
        self, request_id: str, call: UpstreamCall, reading: StreamReading, line: bytes
    ) -> None:
        """The upstream's first byte, if ``line`` is its first event: the request started
        there. A comment (": PROCESSING", which servers send to keep a queued request's
        stream alive) or a blank line is not."""
        if not line.startswith(b"data:"):
            return
        reading.started = time.perf_counter()
        self._answered_at = time.monotonic()
        if call.timer is not None:
            call.timer.cancel()
        self.learned.first_byte(request_id)
        self._room()

    def _end(self, request_id: str, call: UpstreamCall) -> None:
        if call.timer is not None:
            call.timer.cancel()
        if call.response is not None:
            # Read to its end, the connection is kept for the next request; else closed.
            call.response.release()
        del self._calls[request_id]
        self.learned.done(request_id)
        self._room()

    async def _send(
        self, call: UpstreamCall, request_id: str, path: str, body: dict[str, Any]
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
            # stream's headers at once): its close found no response to close and the wait for
            # the headers over. Closed now, not at the first token: the upstream would run the
            # whole prefill of a request no one wants.
            response.close()
            raise call.dropped(request_id, 0.0)
        if response.status in _NO_ROOM:
            response.close()
            if self._down(request_id):
                # With none of ours on it and no first byte for a while: not full but down
                # (a proxy's "no healthy upstream", a server that never came up). An engine
                # error, which the breaker counts and a fallback route answers.
                raise EngineError(
                    f"upstream {self.base_url}{path}: {response.status} with nothing of ours "
                    f"on it and no first byte for {_DOWN_AFTER_S:.0f} s: taken for down"
                )
            # Full (TGI past --max-concurrent-requests, a server overloaded or still
            # loading): the request never started. The worker queues it again, where the
            # shield still reaches it, and sends no more for a while; the upstream is full
            # with what of ours it took, and the limit becomes that.
            self.learned.no_room()
            self._no_room_for(request_id, response.status, path)
            raise EngineFull(
                f"upstream {self.base_url}{path}: {response.status}, no room",
                retry_after=_retry_after(response.headers.get("Retry-After")),
            )
        self._refused_since.pop(request_id, None)
        if response.status != 200:
            detail = (await response.read())[:2000].decode(errors="replace")
            if response.status in REQUEST_REFUSED:
                # The upstream refused the request itself (a prompt over its context,
                # parameters it does not take): the client's doing, not a route fault for
                # the breaker; the upstream's reason goes back to the client, its address not.
                reason = error_reason(detail)
                if (room := context_room(detail)) is not None:
                    raise OverContext(f"the engine refused the request: {reason}", room)
                raise refusal(reason)
            if (unsupported := EngineUnsupported.from_engine(detail)) is not None:
                # A server without what the request asks, at any status (llama.cpp started
                # without --jinja answers tools with a 500): not a fault of the route's.
                raise EngineUnsupported(
                    f"the engine refused the request: {error_reason(detail)}",
                    param=unsupported.param,
                )
            raise EngineError(f"upstream {self.base_url}{path}: {response.status} {detail[:300]}")
        return response

    def _down(self, request_id: str) -> bool:
        """Whether a no-room answer to ``request_id`` says the upstream is down: none of ours
        is on it but this one, and none has had a first byte for ``_DOWN_AFTER_S``."""
        others = len(self._calls) - (request_id in self._calls)
        return others == 0 and time.monotonic() - self._answered_at > _DOWN_AFTER_S

    def _no_room_for(self, request_id: str, status: int, path: str) -> None:
        """A request refused for room this long (the read timeout) fails: a server that
        says it is full for good is down, and a request with no deadline (a batch line)
        would wait for it forever."""
        now = time.monotonic()
        for rid, since in list(self._refused_since.items()):
            if now - since > 2 * self._read_timeout_s:
                del self._refused_since[rid]  # it expired or went elsewhere meanwhile
        since = self._refused_since.setdefault(request_id, now)
        if now - since > self._read_timeout_s:
            del self._refused_since[request_id]
            raise EngineError(
                f"upstream {self.base_url}{path}: {status}, no room for "
                f"{now - since:.0f} s (LANEWAY_UPSTREAM_READ_TIMEOUT_S is "
                f"{self._read_timeout_s:.0f} s)"
            )

    def _room(self) -> None:
        if self._on_room is not None:
            self._on_room()


def _chat_fields(request: EngineRequest, messages: list[ChatMessage]) -> dict[str, Any]:
    """A chat's own fields, as the client sent them: its messages, response format, tools."""
    fields: dict[str, Any] = {"messages": [m.wire() for m in messages]}
    if request.response_format is not None:
        fields["response_format"] = request.response_format
    if request.tools:
        fields["tools"] = request.tools
        if request.tool_choice is not None:
            fields["tool_choice"] = request.tool_choice
        if request.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = request.parallel_tool_calls
    return fields


async def _next_line(response: aiohttp.ClientResponse, *, finished: bool) -> bytes:
    """The stream's next line; b"" at its end. Once the upstream said the request finished
    (a finish_reason), only the usage chunk and [DONE] may follow: an upstream that sends
    neither, nor ends the stream, would hold the request (and its slot) for the read
    timeout, so after _AFTER_FINISH_S of silence it is taken as ended, and closed. Not from
    an upstream seen to send its usage after the finish (``finished`` is False then): that
    usage may come late (vLLM's, under load), and it is the request's true count."""
    if not finished:
        return await response.content.readline()
    try:
        async with asyncio.timeout(_AFTER_FINISH_S):
            return await response.content.readline()
    except TimeoutError:
        response.close()
        return b""


def _retry_after(header: str | None) -> float:
    """The wait an upstream's Retry-After asks for, in seconds (capped; its HTTP-date form
    and a missing one: the default)."""
    try:
        wait = float(header) if header is not None else _NO_ROOM_WAIT_S
    except ValueError:
        wait = _NO_ROOM_WAIT_S
    if not math.isfinite(wait):
        wait = _NO_ROOM_WAIT_S
    return min(_NO_ROOM_MAX_S, max(0.0, wait))


_JSON = {"content-type": "application/json"}
# After a finish_reason, the usage chunk and [DONE] come at once from every server seen; a
# stream silent this long after it is over.
_AFTER_FINISH_S = 2.0
# What an upstream says when it has no room for a request: it never started.
_NO_ROOM = frozenset({429, 503})
# After a no-room answer, no more is sent for its Retry-After, at most _NO_ROOM_MAX_S (a
# server asking for minutes must not hold interactive work past its deadline unseen), or
# _NO_ROOM_WAIT_S without one.
_NO_ROOM_MAX_S = 5.0
_NO_ROOM_WAIT_S = 0.5
# A no-room answer with none of ours on the upstream and no first byte for this long: down.
_DOWN_AFTER_S = 10.0
# An abort waits at most this long for its request's generate to begin.
_EARLY_ABORT_S = 5.0
