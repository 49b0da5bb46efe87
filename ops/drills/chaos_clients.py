"""The chaos drill's clients: completions and streamed chats spread over the ingress
replicas as a load balancer would, each request tagged so it can be found on the request
topics, and every attempt recorded as the client saw it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx
import orjson

__all__ = [
    "Attempt",
    "AttemptOutcome",
    "Balancer",
    "ChaosClients",
    "ClientRequest",
    "tag_of",
    "tag_text",
]

# What an attempt came to, as its client saw it.
AttemptOutcome = Literal["answered", "failed", "transport", "timeout"]
Kind = Literal["completion", "chat"]

_TAG_MARK = "[chaos "


def tag_text(tag: str) -> str:
    """The marker a request carries in its prompt; the audit finds it on the topics."""
    return f"{_TAG_MARK}{tag}]"


def tag_of(text: str) -> str | None:
    """The tag in a prompt (or message) written by ``tag_text``; None without one."""
    start = text.find(_TAG_MARK)
    if start < 0:
        return None
    end = text.find("]", start)
    return text[start + len(_TAG_MARK) : end] if end > 0 else None


@dataclass
class Attempt:
    """One try of a request at one ingress replica (times: seconds since the drill began)."""

    ingress: int
    started: float
    ended: float = 0.0
    outcome: AttemptOutcome = "transport"
    status: int = 0  # HTTP status; 0: no response
    request_id: str | None = None  # from x-laneway-request-id; None: no headers came
    detail: str = ""


@dataclass
class ClientRequest:
    """A request as its client knows it: tried once, and once more elsewhere if the first
    ingress went away under it."""

    tag: str
    kind: Kind
    attempts: list[Attempt] = field(default_factory=list)


class Balancer:
    """Round robin over the ingress replicas still up; one whose connection broke is taken
    out, as a load balancer's health check would."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.down: set[int] = set()

    def pick(self, n: int, avoid: int | None = None) -> int | None:
        live = [i for i in range(len(self.urls)) if i not in self.down and i != avoid]
        return live[n % len(live)] if live else None

    def mark_down(self, index: int) -> None:
        self.down.add(index)


class ChaosClients:
    """Sends tagged completions and streamed chats; ``requests`` holds every one sent."""

    def __init__(
        self,
        urls: Sequence[str],
        key: str,
        *,
        started: float,
        completion_tokens: int = 16,
        chat_tokens: int = 48,
        read_timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.balancer = Balancer(urls)
        self.started = started
        self.completion_tokens = completion_tokens
        self.chat_tokens = chat_tokens
        self.requests: list[ClientRequest] = []
        timeout = httpx.Timeout(read_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
            limits=limits,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def _now(self) -> float:
        return time.monotonic() - self.started

    async def completion(self, n: int, _sent_at: float) -> None:
        body = {
            "model": "laneway-code",
            "prompt": f"# {tag_text(f'c-{n}')}\ndef handler_{n}(request):\n    ",
            "max_tokens": self.completion_tokens,
        }
        await self._send(ClientRequest(f"c-{n}", "completion"), n, "/v1/completions", body)

    async def chat(self, n: int, _sent_at: float) -> None:
        body = {
            "model": "laneway-chat",
            "messages": [{"role": "user", "content": f"{tag_text(f'h-{n}')} explain handler_{n}"}],
            "max_tokens": self.chat_tokens,
            "stream": True,
        }
        await self._send(ClientRequest(f"h-{n}", "chat"), n, "/v1/chat/completions", body)

    async def _send(self, request: ClientRequest, n: int, path: str, body: object) -> None:
        self.requests.append(request)
        avoid = None
        for _ in range(2):  # the first try, and one more on another replica if it broke
            index = self.balancer.pick(n, avoid)
            if index is None:
                return
            attempt = Attempt(index, self._now())
            request.attempts.append(attempt)
            url = self.balancer.urls[index] + path
            try:
                if request.kind == "chat":
                    await self._stream(url, body, attempt)
                else:
                    await self._post(url, body, attempt)
            except httpx.TimeoutException as exc:
                attempt.outcome, attempt.detail = "timeout", type(exc).__name__
            except httpx.TransportError as exc:
                attempt.outcome, attempt.detail = "transport", type(exc).__name__
                self.balancer.mark_down(index)
                avoid = index
            attempt.ended = self._now()
            if attempt.outcome != "transport":
                return

    async def _post(self, url: str, body: object, attempt: Attempt) -> None:
        response = await self.http.post(url, json=body)
        attempt.status = response.status_code
        attempt.request_id = response.headers.get("x-laneway-request-id")
        if response.status_code == 200:
            attempt.outcome = "answered"
        else:
            attempt.outcome, attempt.detail = "failed", _error_code(response.content)

    async def _stream(self, url: str, body: object, attempt: Attempt) -> None:
        async with self.http.stream("POST", url, json=body) as response:
            attempt.status = response.status_code
            attempt.request_id = response.headers.get("x-laneway-request-id")
            if response.status_code != 200:
                attempt.outcome = "failed"
                attempt.detail = _error_code(await response.aread())
                return
            finished = error = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    if error:
                        attempt.outcome = "failed"
                    elif finished:
                        attempt.outcome = "answered"
                    else:
                        attempt.outcome, attempt.detail = "failed", "done without finish_reason"
                    return
                event = orjson.loads(data)
                if "error" in event:
                    error = True
                    attempt.detail = str(event["error"].get("code") or "error event")
                elif any(c.get("finish_reason") for c in event.get("choices", [])):
                    finished = True
            # The stream ended without [DONE]: the connection went away under it.
            raise httpx.RemoteProtocolError("stream ended without [DONE]")


def _error_code(raw: bytes) -> str:
    try:
        error = orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return "not an OpenAI error body"
    return str(error.get("code") or error.get("type") or "error")
