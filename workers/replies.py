"""Where a worker's output goes: reply streams in Redis, usage and results topics in Kafka."""

from __future__ import annotations

import asyncio

import orjson
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from laneway.constants import REPLY_STREAM_MAXLEN, Topics
from laneway.schema import Reply, RequestEnvelope, UsageEvent

__all__ = ["Outbox"]


class Outbox:
    """Sends reply chunks to the ingress that holds the connection, and terminal records."""

    def __init__(self, redis: aioredis.Redis, producer: AIOKafkaProducer, topics: Topics) -> None:
        self.redis = redis
        self.producer = producer
        self.topics = topics

    async def reply(self, stream: str, reply: Reply) -> None:
        await self.redis.xadd(
            stream, {"d": reply.to_json()}, maxlen=REPLY_STREAM_MAXLEN, approximate=True
        )

    async def finish(self, env: RequestEnvelope, final: Reply, usage: UsageEvent) -> None:
        """Final reply (or batch result) and the usage event, both delivered before return."""
        sends = [self.producer.send(self.topics.usage, usage.to_json(), key=env.team.encode())]
        if env.reply_to is None:
            result = {
                "job_id": env.job_id,
                "line_id": env.line_id,
                "id": env.id,
                "team": env.team,
                "status": final.status,
                "text": final.text,
                "finish_reason": final.finish_reason,
                "usage": {
                    "prompt_tokens": final.prompt_tokens,
                    "completion_tokens": final.completion_tokens,
                    "cached_tokens": final.cached_tokens,
                },
                "error": final.error,
            }
            key = (env.job_id or env.id).encode()
            sends.append(
                self.producer.send(self.topics.results_batch, orjson.dumps(result), key=key)
            )
        else:
            await self.reply(env.reply_to, final)
        deliveries = await asyncio.gather(*sends)
        await asyncio.gather(*deliveries)
