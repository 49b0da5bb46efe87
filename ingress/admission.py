"""From a validated OpenAI body to an envelope on the right Kafka lane."""

from __future__ import annotations

import hashlib
import secrets
import time

from aiokafka import AIOKafkaProducer
from starlette.datastructures import Headers

from ingress.auth import Caller
from ingress.openai_api import ChatRequest, CompletionRequest
from laneway.constants import Band, RequestClass
from laneway.errors import BadRequest, ModelNotFound, PromptTooLarge
from laneway.schema import RequestEnvelope
from laneway.settings import IngressSettings
from laneway.tokens import estimate_tokens

__all__ = ["Admission", "new_request_id"]

SESSION_HEADER = "x-laneway-session"
SEQ_HEADER = "x-laneway-seq"
PRIORITY_HEADER = "x-laneway-priority"
DEADLINE_HEADER = "x-laneway-deadline-ms"


def new_request_id(kind: str) -> str:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{secrets.token_hex(12)}"


def _int_header(headers: Headers, name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"header {name}: {raw!r} is not an integer", param=name) from None


class Admission:
    """Builds envelopes (class, band, route, deadline, affinity) and produces them."""

    def __init__(self, settings: IngressSettings, producer: AIOKafkaProducer) -> None:
        self.settings = settings
        self.producer = producer
        self.topics = settings.topics
        self._models = set(settings.models)

    def envelope(
        self,
        caller: Caller,
        body: CompletionRequest | ChatRequest,
        headers: Headers,
        *,
        reply_to: str,
    ) -> RequestEnvelope:
        s = self.settings
        if body.model not in self._models:
            raise ModelNotFound(
                f"model {body.model!r} is not served here; available: {sorted(self._models)} "
                "(LANEWAY_MODELS)",
                param="model",
            )
        cls: RequestClass
        if isinstance(body, CompletionRequest):
            cls, kind = "completion", "completion"
            prompt, messages, suffix = body.prompt, None, body.suffix
            cap, deadline_ms, max_tokens = (
                s.completion_max_tokens,
                s.completion_deadline_ms,
                body.max_tokens,
            )
        else:
            cls, kind = "chat", "chat"
            messages, suffix = body.flat_messages(), None
            prompt = "".join(m.content for m in messages)
            cap, deadline_ms = s.chat_max_tokens, s.chat_deadline_ms
            max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens = max_tokens or cap
        if max_tokens > cap:
            setting = (
                "LANEWAY_COMPLETION_MAX_TOKENS"
                if cls == "completion"
                else "LANEWAY_CHAT_MAX_TOKENS"
            )
            raise BadRequest(
                f"max_tokens {max_tokens} is over the {cls} limit {cap} ({setting})",
                param="max_tokens",
            )
        prompt_tokens = estimate_tokens(prompt) + estimate_tokens(suffix or "")
        if prompt_tokens > s.max_prompt_tokens:
            raise PromptTooLarge(
                f"prompt is about {prompt_tokens} tokens, over the limit {s.max_prompt_tokens} "
                "(LANEWAY_MAX_PROMPT_TOKENS)",
                param="messages" if messages is not None else "prompt",
            )

        band: Band = caller.team.tier
        asked = headers.get(PRIORITY_HEADER)
        if asked is not None:
            if asked not in ("hi", "lo"):
                raise BadRequest(
                    f"header {PRIORITY_HEADER}: {asked!r} must be 'hi' or 'lo'",
                    param=PRIORITY_HEADER,
                )
            if asked == "lo":  # a header may only lower the team's band
                band = "lo"
        header_deadline = _int_header(headers, DEADLINE_HEADER)
        if header_deadline is not None:
            if header_deadline <= 0:
                raise BadRequest(
                    f"header {DEADLINE_HEADER}: {header_deadline} must be positive",
                    param=DEADLINE_HEADER,
                )
            deadline_ms = min(deadline_ms, header_deadline)
        session = headers.get(SESSION_HEADER)
        seq = _int_header(headers, SEQ_HEADER)
        if session is not None:
            affinity = f"s:{session}"
        else:
            head = prompt[: s.affinity_prefix_chars].encode()
            affinity = "p:" + hashlib.blake2b(head, digest_size=8).hexdigest()
        now = time.time()
        return RequestEnvelope(
            id=new_request_id(kind),
            team=caller.team.name,
            cls=cls,
            band=band,
            kind=kind,
            model=body.model,
            route=body.model,
            prompt=prompt if messages is None else "",
            suffix=suffix,
            messages=messages,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop,
            stream=body.stream,
            session=session,
            seq=seq,
            affinity=affinity,
            reply_to=reply_to,
            accepted_ts=now,
            deadline_ts=now + deadline_ms / 1000,
            prompt_tokens=prompt_tokens,
        )

    async def produce(self, env: RequestEnvelope) -> None:
        """Returns once the broker has stored the envelope: from then on it cannot be lost."""
        await self.producer.send_and_wait(
            self.topics.request(env.cls, env.band), env.to_json(), key=env.affinity.encode()
        )
