"""From a validated OpenAI body to an envelope on the right Kafka lane."""

from __future__ import annotations

import hashlib
import secrets
import time

from aiokafka import AIOKafkaProducer
from starlette.datastructures import Headers

from ingress.auth import Caller
from laneway.constants import Band, RequestClass
from laneway.errors import BadRequest
from laneway.openai_api import ChatRequest, CompletionRequest
from laneway.requests import shape_request
from laneway.schema import RequestEnvelope
from laneway.settings import IngressSettings

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

    def envelope(
        self,
        caller: Caller,
        body: CompletionRequest | ChatRequest,
        headers: Headers,
        *,
        reply_to: str,
    ) -> RequestEnvelope:
        s = self.settings
        cls: RequestClass = "completion" if isinstance(body, CompletionRequest) else "chat"
        shape = shape_request(s, body, cls)
        deadline_ms = s.completion_deadline_ms if cls == "completion" else s.chat_deadline_ms
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
            head = shape.prompt[: s.affinity_prefix_chars].encode()
            affinity = "p:" + hashlib.blake2b(head, digest_size=8).hexdigest()
        now = time.time()
        return shape.envelope(
            id=new_request_id(shape.kind),
            team=caller.team.name,
            cls=cls,
            band=band,
            stream=body.stream,
            session=session,
            seq=seq,
            affinity=affinity,
            reply_to=reply_to,
            accepted_ts=now,
            deadline_ts=now + deadline_ms / 1000,
            supersede_grace_tokens=caller.team.supersede_grace_tokens,
            # Completions only: a chat or batch answer is not ghost text to type through.
            reuse=cls == "completion" and caller.team.type_through,
        )

    async def produce(self, env: RequestEnvelope) -> None:
        """Returns once the broker has stored the envelope: from then on it cannot be lost."""
        await self.producer.send_and_wait(
            self.topics.request(env.cls, env.band), env.to_json(), key=env.affinity.encode()
        )
