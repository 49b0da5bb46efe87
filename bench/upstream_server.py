"""A stand-in for a separate OpenAI-compatible inference server that logs its own work.

``python -m bench.upstream_server --port P --slots 8 --token-ms 15 --log work.jsonl``

It behaves as vLLM's OpenAI server does where laneway's shield is concerned: at most
``--slots`` requests decode at once and the rest wait in its own queue (first come, first
served), a token takes ``--token-ms`` for every running request, and a client that
disconnects cancels its request whether it is still queued or already running. It is not a
model: the text is made-up words, ``max_tokens`` of them (fewer when it meets a ``stop`` string).

Each request it received writes one JSON line to ``--log`` when it ends: ``recv``, ``start``
(a slot was free: the work began, or null), ``queued`` (no slot was free when it arrived,
so it waited in this server's queue), ``end``, ``tokens``, ``outcome`` (``done``,
``gone_queued``, ``gone_running``), ``stream``, ``prompt`` (the prompt or the last chat
message) and ``cache_salt`` (vLLM's prefix-cache salt as sent, or null), with times from
``time.time()``. Benches and tests judge laneway by this log, which laneway does not write.
``sampling`` (the fields that steer the text, as received: ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, ``suffix``, those sent) and ``finish`` (``length``, or ``stop``:
the text reached one of ``stop``'s strings and ends before it, as vLLM's does).
``--prefill-ms`` is the time before a request's first token; ``--cold-prefill-ms`` that of a
prompt with ``cold`` in it (a prefix-cache miss, for first bytes that vary with no queue).
``--when-full 429`` (or ``503``) answers a request that finds no free slot with that status
(and ``--retry-after``'s value as its Retry-After), as TGI past ``--max-concurrent-requests``
or an overloaded server does, instead of queueing it (outcome ``full``).
``--keepalive-ms N`` begins a streamed answer at once and sends it a ``: PROCESSING`` comment
line every N ms while it waits for a slot and its first token (as OpenRouter-style servers do).
``--tokens-always N`` generates N tokens whatever ``max_tokens`` asks (a server that ignores
it); ``--tokens-per-chunk N`` streams N tokens in each chunk (as a server with speculative
decoding, or vLLM's ``--stream-interval``, does); ``--silent-after-finish`` sends a stream's last chunk (finish reason, usage) and then
neither ``[DONE]`` nor the stream's end until the client leaves; ``--usage-apart-ms N`` sends
usage in a chunk of its own after the finish (as vLLM does), N ms later for a prompt that
starts with "late".
A chat with ``tools`` (and a ``tool_choice`` other than ``none``) calls them instead of writing
text, as a model served with a tool parser does: the named tool, else the first (and the
second too, unless ``parallel_tool_calls`` is false), its arguments ``{"text": "<the words>"}``
streamed a word a chunk as vLLM streams them, ``finish_reason`` ``tool_calls`` (``stop`` for a
named one, as vLLM and OpenAI answer it). The log then
has ``tools`` (their names), ``tool_choice`` (as received), ``called`` (the names called) and
``history`` (the messages that carry ``tool_calls`` or have the role ``tool``, as received).
``response_format`` and ``names`` (the messages' ``name``, in order) are logged as received
when a request has them; neither changes the text.
``--max-model-len N`` refuses a request whose prompt (four characters a token) and
``max_tokens`` exceed N tokens with vLLM's 400 and message (outcome ``refused``); a chat with
no ``max_tokens`` then gets what the context leaves, as from vLLM (else 16 tokens).
``--metrics`` serves vLLM's ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (modelled as the share of its slots in use) on ``/metrics`` (as
vLLM does; without it, it is a server that publishes no queue length); ``/stats`` has the
two counts as JSON, always. ``POST /metrics_text`` with ``{"text": "..."}`` serves that text as
``/metrics`` instead (another server's gauges, a bad value), ``{"text": null}`` its own again.

For tests that need one request to keep its slot until they say so (instead of a race against
the clock): ``POST /hold`` with ``{"prompts": [...]}`` makes a request with one of those prompts
hold its slot, before its first token, until ``POST /release`` with ``{"prompts": [...]}``.
A release naming a prompt that is not held releases none (400); holding a released prompt again
holds the next request with it; ``/hold`` answers with the prompts held now.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import orjson
from aiohttp import web

_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "suffix",
)
_WORDS = ("alpha ", "beta ", "gamma ", "delta ", "omega ", "sigma ", "kappa ", "theta ")


@dataclass
class Upstream:
    slots: int
    token_ms: float
    prefill_ms: float = 0.0
    log: TextIO | None = None
    cold_prefill_ms: float = 0.0  # a prompt with "cold" in it: a prefix-cache miss
    max_model_len: int = 0  # 0: no limit
    end_ms: float = 0.0  # between a stream's last token and its last chunk (usage, finish)
    running: int = 0
    waiting: int = 0
    held: dict[str, asyncio.Event] = field(default_factory=dict)  # prompt -> released
    keepalive_ms: float = 0.0  # a streamed request's ": PROCESSING" comments until its first token
    tokens_always: int = 0  # generate this many tokens whatever max_tokens says; 0: max_tokens
    tokens_per_chunk: int = 1  # tokens streamed in one chunk (the last may have fewer)
    silent_after_finish: bool = False  # after the last chunk, no [DONE] and no end
    # Usage in a chunk of its own after the finish, as vLLM sends it: at once, or this long
    # after it for a prompt that starts with "late" (None: in the finish chunk).
    usage_apart_ms: float | None = None
    when_full: int = 0  # answer this status (429, 503) when no slot is free; 0: queue
    retry_after: str = ""  # the Retry-After header of that answer ("": none)
    metrics_text: str | None = None  # set by POST /metrics_text: served as /metrics instead
    _slots: asyncio.Semaphore = field(init=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.slots)

    def record(self, entry: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(orjson.dumps(entry).decode() + "\n")
            self.log.flush()

    @contextlib.asynccontextmanager
    async def slot(self, entry: dict[str, Any]) -> AsyncIterator[None]:
        """Wait for a decode slot (cancelled, the request never starts) and hold it."""
        entry["queued"] = self._slots.locked()  # no free slot when it arrived: it waits here
        self.waiting += 1
        try:
            await self._slots.acquire()
        except asyncio.CancelledError:
            entry["outcome"] = "gone_queued"
            raise
        finally:
            self.waiting -= 1
        entry["start"] = time.time()
        self.running += 1
        try:
            yield
        except (asyncio.CancelledError, ConnectionError):
            entry["outcome"] = "gone_running"
            raise
        finally:
            self.running -= 1
            self._slots.release()

    async def tokens(self, count: int, entry: dict[str, Any]) -> AsyncIterator[str]:
        """``count`` words, one per token time (prefill first), counted into ``entry``."""
        released = self.held.get(entry["prompt"])
        if released is not None:
            await released.wait()
        prefill_ms = self.cold_prefill_ms if "cold" in entry["prompt"] else self.prefill_ms
        if prefill_ms:
            await asyncio.sleep(prefill_ms / 1000)
        stop = entry["sampling"].get("stop") or []
        stops = [stop] if isinstance(stop, str) else [str(s) for s in stop if s]
        text = ""
        for i in range(count):
            if self.token_ms:
                await asyncio.sleep(self.token_ms / 1000)
            entry["tokens"] = i + 1
            word = _WORDS[i % len(_WORDS)]
            ends = [at for at in ((text + word).find(s) for s in stops) if at >= 0]
            if ends:  # the text ends before the stop string, which is not sent
                entry["finish"] = "stop"
                if min(ends) > len(text):
                    yield (text + word)[len(text) : min(ends)]
                return
            text += word
            yield word


def _too_long(upstream: Upstream, body: dict[str, Any], count: int) -> web.Response | None:
    """vLLM's answer to a request longer than its context, or None."""
    if not upstream.max_model_len:
        return None
    prompt = _prompt_tokens(body)
    if prompt + count <= upstream.max_model_len:
        return None
    message = (
        f"This model's maximum context length is {upstream.max_model_len} tokens. However, "
        f"you requested {prompt + count} tokens ({prompt} in the messages, {count} in the "
        "completion). Please reduce the length of the messages or completion."
    )
    error = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
    return web.json_response(error, status=400)


def _count(upstream: Upstream, body: dict[str, Any], *, chat: bool) -> int:
    """The tokens a request asks for: its ``max_tokens``; a chat that sets none, what the
    context leaves (vLLM's default) where ``--max-model-len`` says, else 16 (a completion's
    default too)."""
    if body.get("max_tokens"):
        return int(body["max_tokens"])
    if chat and upstream.max_model_len:
        return max(1, upstream.max_model_len - _prompt_tokens(body))
    return 16


def _prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's length in tokens: four characters a token, of every message."""
    messages = body.get("messages")
    text = "".join(str(m.get("content", "")) for m in messages) if messages else _prompt(body)
    return (len(text) + 3) // 4


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        messages = body.get("messages") or [{}]
        return str(messages[-1].get("content", ""))
    return str(body.get("prompt", ""))


async def _generate(request: web.Request) -> web.StreamResponse:
    upstream: Upstream = request.app["upstream"]
    body = orjson.loads(await request.read())
    chat = request.path.endswith("/chat/completions")
    stream = bool(body.get("stream"))
    count = upstream.tokens_always or _count(upstream, body, chat=chat)
    rid = f"up-{next(upstream._ids)}"
    entry: dict[str, Any] = {
        "id": rid,
        "recv": time.time(),
        "start": None,
        "queued": False,
        "end": None,
        "tokens": 0,
        "outcome": "done",
        "stream": stream,
        "prompt": _prompt(body),
        "cache_salt": body.get("cache_salt"),
        "sampling": {name: body[name] for name in _SAMPLING if name in body},
        "finish": "length",
    }
    called = _called(body) if chat else []
    if "response_format" in body:
        entry["response_format"] = body["response_format"]
    if chat and (names := [m["name"] for m in body.get("messages") or () if "name" in m]):
        entry["names"] = names
    if chat and ("tools" in body or any(_tool_message(m) for m in body.get("messages") or ())):
        entry["tools"] = [tool["function"]["name"] for tool in body.get("tools") or ()]
        entry["tool_choice"] = body.get("tool_choice")
        entry["called"] = called
        entry["history"] = [m for m in body.get("messages") or () if _tool_message(m)]
    refused = _too_long(upstream, body, count)
    if refused is not None:
        upstream.record({**entry, "outcome": "refused", "end": time.time()})
        return refused
    if upstream.when_full and upstream._slots.locked():
        # As TGI past --max-concurrent-requests (429), or a server overloaded (503).
        upstream.record({**entry, "outcome": "full", "end": time.time()})
        headers = {"Retry-After": upstream.retry_after} if upstream.retry_after else {}
        error = {"error": "Model is overloaded", "error_type": "overloaded"}
        return web.json_response(error, status=upstream.when_full, headers=headers)
    response: web.StreamResponse | None = None
    pings: asyncio.Task[None] | None = None
    if stream and upstream.keepalive_ms:
        # As OpenRouter-style servers do: the stream begins at once, and comment lines keep
        # it alive while the request waits for a slot and its first token.
        response = await _event_stream(request)
        pings = asyncio.create_task(_ping(response, upstream.keepalive_ms))
    try:
        async with upstream.slot(entry):
            if called:
                named = isinstance(body.get("tool_choice"), dict)
                return await _call_tools(
                    request, upstream, rid, called, count, entry, stream, named
                )
            if stream:
                return await _stream(request, upstream, rid, chat, count, entry, response, pings)
            text = "".join([word async for word in upstream.tokens(count, entry)])
            return web.json_response(_body(rid, chat, text, entry), dumps=_dumps)
    except ConnectionError:
        # The client left as its stream began (logged as gone_running): no one to answer.
        return web.Response(status=499)
    finally:
        if pings is not None:
            pings.cancel()
        entry["end"] = time.time()
        upstream.record(entry)


async def _event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _ping(response: web.StreamResponse, every_ms: float) -> None:
    while True:
        await response.write(b": PROCESSING\n\n")
        await asyncio.sleep(every_ms / 1000)


async def _stream(
    request: web.Request,
    upstream: Upstream,
    rid: str,
    chat: bool,
    count: int,
    entry: dict[str, Any],
    response: web.StreamResponse | None = None,
    pings: asyncio.Task[None] | None = None,
) -> web.StreamResponse:
    if response is None:
        response = await _event_stream(request)
    words: list[str] = []
    async for word in upstream.tokens(count, entry):
        if pings is not None:
            pings.cancel()
            pings = None
        words.append(word)
        if len(words) >= upstream.tokens_per_chunk:
            await response.write(_text_chunk(rid, chat, "".join(words)))
            words.clear()
    if words:
        await response.write(_text_chunk(rid, chat, "".join(words)))
    if upstream.end_ms:
        await asyncio.sleep(upstream.end_ms / 1000)
    last = {
        "id": rid,
        "object": "chunk",
        "choices": [{"index": 0, "finish_reason": entry["finish"], "delta": {}, "text": ""}],
        "usage": reported_usage(entry),
    }
    if upstream.usage_apart_ms is not None:
        usage = {"id": rid, "object": "chunk", "choices": [], "usage": last.pop("usage")}
        await response.write(b"data: " + orjson.dumps(last) + b"\n\n")
        if entry["prompt"].startswith("late"):
            await asyncio.sleep(upstream.usage_apart_ms / 1000)
        last = usage
    if upstream.silent_after_finish:
        # Its last chunk, then neither [DONE] nor the stream's end, until the client leaves.
        await response.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await asyncio.Event().wait()
    await response.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


def _called(body: dict[str, Any]) -> list[str]:
    """The tools a chat calls: none without tools or with ``tool_choice`` none."""
    tools = [tool["function"]["name"] for tool in body.get("tools") or ()]
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return []
    if isinstance(choice, dict):
        return [choice["function"]["name"]]
    return tools[:1] if body.get("parallel_tool_calls") is False else tools[:2]


def _tool_message(message: dict[str, Any]) -> bool:
    return bool(message.get("tool_calls")) or message.get("role") == "tool"


async def _call_tools(
    request: web.Request,
    upstream: Upstream,
    rid: str,
    called: list[str],
    count: int,
    entry: dict[str, Any],
    stream: bool,
    named: bool,
) -> web.StreamResponse:
    """Call ``called`` one after the other, the words split between their arguments. As
    vLLM and OpenAI answer: ``finish_reason`` ``tool_calls``, but ``stop`` for a call that
    ``tool_choice`` ``named``."""
    entry["finish"] = "stop" if named else "tool_calls"
    share = max(1, count // len(called))
    words = upstream.tokens(count, entry)
    calls: list[dict[str, Any]] = []
    response = await _event_stream(request) if stream else None
    for index, name in enumerate(called):
        call = {"id": f"call_{rid}_{index}", "type": "function", "function": {"name": name}}
        parts = ['{"text": "']
        sent = 0  # parts streamed: each chunk one token, as a server streams its calls
        async for word in words:
            parts.append(word)
            if response is not None and len(parts) > 2:
                await response.write(_calls_chunk(rid, index, call, parts, sent))
                sent = len(parts) - 1
            if len(parts) > share and index < len(called) - 1:
                break
        parts.append('"}')
        if response is not None:
            await response.write(_calls_chunk(rid, index, call, parts, sent))
        calls.append({**call, "function": {"name": name, "arguments": "".join(parts)}})
    if response is None:
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        choice = {"index": 0, "finish_reason": entry["finish"], "message": message}
        body = {"id": rid, "object": "chat.completion", "choices": [choice]}
        return web.json_response({**body, "usage": reported_usage(entry)}, dumps=_dumps)
    last = {
        "id": rid,
        "object": "chunk",
        "choices": [{"index": 0, "finish_reason": entry["finish"], "delta": {}}],
        "usage": reported_usage(entry),
    }
    await response.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


def _calls_chunk(rid: str, index: int, call: dict[str, Any], parts: list[str], sent: int) -> bytes:
    """A chunk of ``call``'s arguments: ``parts`` after the ``sent`` first, but the last
    (its token comes with the next chunk); the first chunk of a call has its id and name."""
    pending = parts[sent:] if parts[-1] == '"}' else parts[sent:-1]
    arguments = {"arguments": "".join(pending)}
    first = {**call, "function": {**call["function"], **arguments}}
    part = first if sent == 0 else {"function": arguments}
    delta = {"tool_calls": [{"index": index, **part}]}
    chunk = {"id": rid, "object": "chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _text_chunk(rid: str, chat: bool, text: str) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    chunk = {"id": rid, "object": "chunk", "choices": [choice]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def reported_usage(entry: dict[str, Any]) -> dict[str, int]:
    """The ``usage`` this server answers a request of its log with (a token is four
    characters of the prompt, and each word generated)."""
    prompt = max(1, len(entry["prompt"]) // 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": entry["tokens"],
        "total_tokens": prompt + entry["tokens"],
    }


def _body(rid: str, chat: bool, text: str, entry: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": entry["finish"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "completion", "choices": [choice], "usage": reported_usage(entry)}


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _metrics(request: web.Request) -> web.Response:
    upstream: Upstream = request.app["upstream"]
    if upstream.metrics_text is not None:
        return web.Response(text=upstream.metrics_text)
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="up"}} {upstream.running}.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="up"}} {upstream.waiting}.0\n'
        # Its KV cache modelled as its slots: each running request holds one slot's share.
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="up"}} {upstream.running / upstream.slots}\n'
    )
    return web.Response(text=text)


async def _stats(request: web.Request) -> web.Response:
    upstream: Upstream = request.app["upstream"]
    return web.json_response({"running": upstream.running, "waiting": upstream.waiting})


async def _hold(request: web.Request) -> web.Response:
    upstream: Upstream = request.app["upstream"]
    for prompt in _prompts(await request.read()):
        released = upstream.held.get(prompt)
        if released is None or released.is_set():  # held again after a release: the next waits
            upstream.held[prompt] = asyncio.Event()
    return web.json_response(
        {"held": sorted(p for p, e in upstream.held.items() if not e.is_set())}
    )


async def _release(request: web.Request) -> web.Response:
    upstream: Upstream = request.app["upstream"]
    prompts = _prompts(await request.read())
    unknown = [p for p in prompts if p not in upstream.held]
    if unknown:  # all or nothing: a typo releases none of the others
        raise web.HTTPBadRequest(text=f"not held (POST /hold first): {unknown!r}")
    for prompt in prompts:
        upstream.held[prompt].set()
    return web.json_response(
        {"released": sorted(p for p, e in upstream.held.items() if e.is_set())}
    )


def _prompts(raw: bytes) -> list[str]:
    try:
        prompts = orjson.loads(raw)["prompts"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise web.HTTPBadRequest(text='expected {"prompts": ["...", ...]}') from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise web.HTTPBadRequest(text='"prompts" must be a list of strings')
    return prompts


async def _set_metrics_text(request: web.Request) -> web.Response:
    upstream: Upstream = request.app["upstream"]
    text = orjson.loads(await request.read()).get("text")
    if text is not None and not isinstance(text, str):
        raise web.HTTPBadRequest(text='expected {"text": "..."} or {"text": null}')
    upstream.metrics_text = text
    return web.json_response({"text": text})


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "up", "object": "model"}]})


def make_app(upstream: Upstream, *, metrics: bool) -> web.Application:
    app = web.Application()
    app["upstream"] = upstream
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/stats", _stats)  # for benches and tests, with or without --metrics
    app.router.add_post("/hold", _hold)  # for tests: keep a request on its slot until /release
    app.router.add_post("/release", _release)
    if metrics:
        app.router.add_get("/metrics", _metrics)
        app.router.add_post("/metrics_text", _set_metrics_text)
    return app


async def serve(args: argparse.Namespace) -> None:
    # A line per request, flushed as it ends: blocking writes are the log's whole point.
    log = open(args.log, "a", encoding="utf-8") if args.log else None  # noqa: SIM115, ASYNC230
    upstream = Upstream(
        args.slots,
        args.token_ms,
        args.prefill_ms,
        log,
        args.cold_prefill_ms,
        args.max_model_len,
        args.end_ms,
    )
    # handler_cancellation: a client that goes away cancels its handler, queued or running,
    # as vLLM's server aborts a request whose connection closed.
    upstream.when_full, upstream.retry_after = args.when_full, args.retry_after
    upstream.keepalive_ms = args.keepalive_ms
    upstream.tokens_always = args.tokens_always
    upstream.tokens_per_chunk = args.tokens_per_chunk
    upstream.silent_after_finish = args.silent_after_finish
    upstream.usage_apart_ms = args.usage_apart_ms
    runner = web.AppRunner(
        make_app(upstream, metrics=args.metrics), handler_cancellation=True, access_log=None
    )
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    print(f"upstream listening on 127.0.0.1:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if log is not None:
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_server", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    parser.add_argument("--token-ms", type=float, default=15.0, help="time per token")
    parser.add_argument("--prefill-ms", type=float, default=0.0, help="time before the first")
    parser.add_argument(
        "--cold-prefill-ms",
        type=float,
        default=0.0,
        help='time before the first token of a prompt with "cold" in it (a prefix-cache miss)',
    )
    parser.add_argument(
        "--when-full",
        type=int,
        choices=(0, 429, 503),
        default=0,
        help="answer this status when no slot is free (0: queue the request)",
    )
    parser.add_argument(
        "--tokens-always",
        type=int,
        default=0,
        help="generate this many tokens whatever max_tokens asks (0: as max_tokens asks)",
    )
    parser.add_argument(
        "--tokens-per-chunk",
        type=int,
        default=1,
        help="tokens streamed in each chunk (as speculative decoding or vLLM's --stream-interval)",
    )
    parser.add_argument(
        "--silent-after-finish",
        action="store_true",
        help="after a stream's last chunk send neither [DONE] nor its end, until the client leaves",
    )
    parser.add_argument(
        "--usage-apart-ms",
        type=float,
        default=None,
        help="send usage in a chunk of its own after the finish (as vLLM), this long after it "
        "for a prompt that starts with 'late', at once for others",
    )
    parser.add_argument(
        "--keepalive-ms",
        type=float,
        default=0.0,
        help='a streamed request gets ": PROCESSING" comments this often until its first token',
    )
    parser.add_argument("--retry-after", default="", help="the Retry-After of that answer")
    parser.add_argument("--log", default="", help="JSON lines, one per request, when it ends")
    parser.add_argument("--metrics", action="store_true", help="serve vLLM-style /metrics")
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="refuse longer requests with 400 (0: none)"
    )
    parser.add_argument(
        "--end-ms",
        type=float,
        default=0.0,
        help="a stream's last chunk (finish reason, usage) this long after its last token",
    )
    args = parser.parse_args(argv)
    if args.slots < 1:
        parser.error(f"--slots must be at least 1, got {args.slots}")
    if args.tokens_per_chunk < 1:
        parser.error(f"--tokens-per-chunk must be at least 1, got {args.tokens_per_chunk}")
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator

        runner_factory = uvloop.new_event_loop
    except ImportError:
        runner_factory = None
    with asyncio.Runner(loop_factory=runner_factory) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
