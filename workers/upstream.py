"""The ``openai`` engine: any OpenAI-compatible server (vLLM serve, SGLang, llama.cpp, TGI).

Requests stream over HTTP; an abort closes the stream, which every such server treats as a
cancel. Engine time is wall time from the request to its last chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from laneway.errors import Aborted, EngineError
from laneway.tokens import estimate_tokens
from workers.integrity import model_digest
from workers.types import EngineDelta, EngineRequest, EngineStats

__all__ = ["OpenAICompatibleEngine"]


class OpenAICompatibleEngine:
    name = "openai"
    is_simulation = False

    def __init__(self, base_url: str, *, api_key: str = "", model: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )
        self._aborted: set[str] = set()
        self._running = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self._client.aclose()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running)

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
        }
        if request.stop:
            body["stop"] = request.stop
        if request.messages is not None:
            body["messages"] = [m.model_dump() for m in request.messages]
            return "/chat/completions", body
        body["prompt"] = request.prompt
        if request.suffix is not None:
            body["suffix"] = request.suffix
        return "/completions", body

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        path, body = self._body(request)
        started = time.perf_counter()
        prompt_tokens = estimate_tokens(request.prompt)
        completion_tokens = 0
        cached = 0
        finish: str | None = None
        self._running += 1
        try:
            async with self._client.stream("POST", path, content=orjson.dumps(body)) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode(errors="replace")
                    raise EngineError(
                        f"upstream {self.base_url}{path}: {resp.status_code} {detail}"
                    )
                async for line in resp.aiter_lines():
                    if request.id in self._aborted:
                        raise Aborted(f"request {request.id} aborted upstream")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = orjson.loads(data)
                    usage = chunk.get("usage") or {}
                    if usage:
                        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        cached = int(details.get("cached_tokens") or 0)
                        completion_tokens = usage.get("completion_tokens", completion_tokens)
                    text = ""
                    for choice in chunk.get("choices") or []:
                        text += (
                            (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        )
                        finish = choice.get("finish_reason") or finish
                    if text and not usage:
                        completion_tokens += 1
                    if text or usage:
                        yield EngineDelta(
                            text=text,
                            prompt_tokens=prompt_tokens,
                            cached_tokens=cached,
                            completion_tokens=completion_tokens,
                            engine_ms=(time.perf_counter() - started) * 1000,
                        )
            yield EngineDelta(
                text="",
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                completion_tokens=completion_tokens,
                engine_ms=(time.perf_counter() - started) * 1000,
                finish_reason=finish or "stop",
            )
        except httpx.HTTPError as exc:
            raise EngineError(f"upstream {self.base_url}{path}: {exc!r}") from exc
        finally:
            self._running -= 1
            self._aborted.discard(request.id)
