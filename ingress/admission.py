"""From a validated OpenAI body to an envelope on the right Kafka lane."""

from __future__ import annotations

import hashlib
import secrets

from aiokafka import AIOKafkaProducer
from starlette.datastructures import Headers

from ingress.auth import Caller
from ingress.headers import LanewayHeaders
from ingress.settings import IngressSettings
from laneway.clock import RedisClock
from laneway.constants import RequestClass
from laneway.openai_api import ChatRequest, CompletionRequest
from laneway.requests import shape_request
from laneway.schema import RequestEnvelope

__all__ = ["Admission", "affinity_key", "new_request_id"]


def new_request_id(kind: str) -> str:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{secrets.token_hex(12)}"


def affinity_key(team: str, session: str | None, prompt_head: str = "") -> str:
    """The Kafka key of a request: its team's session, else its team and prompt prefix.

    The team is part of it: a session is a name a team chose, and two teams' documents of
    the same name are two sessions (nor do two teams share a worker's prefix cache by it).
    """
    if session is not None:
        scoped = f"{team}\0{session}".encode(errors="surrogatepass")
        return "s:" + hashlib.blake2b(scoped, digest_size=8).hexdigest()
    scoped = f"{team}\0{prompt_head}".encode(errors="surrogatepass")
    return "p:" + hashlib.blake2b(scoped, digest_size=8).hexdigest()


class Admission:
    """Builds envelopes (class, band, route, deadline, affinity) and produces them."""

    def __init__(
        self, settings: IngressSettings, producer: AIOKafkaProducer, clock: RedisClock
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.clock = clock
        self.topics = settings.topics

    def envelope(
        self,
        caller: Caller,
        body: CompletionRequest | ChatRequest,
        headers: Headers,
        *,
        reply_to: str,
        ingress: str | None = None,
    ) -> RequestEnvelope:
        s = self.settings
        cls: RequestClass = "completion" if isinstance(body, CompletionRequest) else "chat"
        shape = shape_request(s, body, cls)
        asked = LanewayHeaders.parse(headers)
        deadline_ms = s.completion_deadline_ms if cls == "completion" else s.chat_deadline_ms
        if asked.deadline_ms is not None:
            deadline_ms = min(deadline_ms, asked.deadline_ms)
        team = caller.team.name
        head = "" if asked.session is not None else shape.prompt[: s.affinity_prefix_chars]
        now = self.clock.now()  # Redis's clock: workers judge the deadline on it too
        return shape.envelope(
            id=new_request_id(shape.kind),
            team=team,
            cls=cls,
            band=asked.band(caller.team.tier),
            stream=body.stream,
            session=asked.session,
            seq=asked.seq,
            affinity=affinity_key(team, asked.session, head),
            reply_to=reply_to,
            ingress=ingress,
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
