"""The upstream's own queue length and KV-cache usage, read from its ``/metrics``.

Where a server publishes them (vLLM, SGLang; llama.cpp and TGI their queue only), its queue
helps learn its capacity
(``workers.learned_slots``) and its KV-cache usage is its memory pressure (``workers.memory``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import aiohttp

from workers.learned_slots import LearnedSlots

__all__ = ["UpstreamMetrics"]

log = logging.getLogger(__name__)

# The queue length that vLLM, SGLang, llama.cpp (requests deferred for want of a free slot)
# and TGI publish on /metrics.
_WAITING = re.compile(
    rb"^(?:vllm:num_requests_waiting|sglang:num_queue_reqs|llamacpp:requests_deferred"
    rb"|tgi_queue_size)(?:\{[^}]*\})? (\S+)",
    re.M,
)
# Their KV-cache usage, a share 0..1 (vLLM's V1 and V0 names, SGLang's), for memory pressure.
_KV_USAGE = re.compile(
    rb"^(?:vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc|sglang:token_usage)"
    rb"(?:\{[^}]*\})? (\S+)",
    re.M,
)
# The upstream's metrics are read every interval_s; missed this many times in a row,
# what they last said no longer counts.
_STALE_READINGS = 3


class UpstreamMetrics:
    """The last reading of an upstream's metrics, every ``interval_s`` while ``poll`` runs."""

    def __init__(self, url: str, interval_s: float, learned: LearnedSlots) -> None:
        self.url = url
        self.interval_s = interval_s
        self.learned = learned
        self.waiting = 0
        self.kv_usage = 0.0
        self.at = -math.inf  # monotonic time of the last reading
        # A reading older than this says nothing: kept, a queue or a pressure seen once
        # would hold work back for good.
        self.stale_after_s = _STALE_READINGS * interval_s
        self._odd_logged = False  # a non-finite or negative gauge was logged
        self._counted = False  # the last reading had a waiting count

    def _value(self, found: re.Match[bytes] | None) -> float | None:
        """A gauge's value; None for one not there, or not a finite number (``+Inf``,
        ``NaN``: nothing to go by, and the rest of the reading still counts)."""
        if found is None:
            return None
        value = float(found.group(1))  # ValueError for one that is no number: unreadable
        if math.isfinite(value) and value >= 0:
            return value
        if not self._odd_logged:
            self._odd_logged = True
            log.warning(
                "upstream metrics at %s say %s, which is no count or share: that reading is "
                "ignored until it is one (logged once)",
                self.url,
                found.group(0)[:120].decode(errors="replace"),
            )
        return None

    def _queue(self, queue: float | None) -> None:
        """The upstream's queue as this reading says it. A reading with no count of it (no
        gauge, or one that is no count) is read as a server's that publishes none: the last
        count, kept, would pass for fresh while the KV gauge still reads, and stay the only
        word on the queue, so that a queue grown since would never show as stalls."""
        if queue is None:
            if self._counted:
                # No longer fresh from now on: the first-byte stall rule is the word again.
                self.learned.upstream_load(0, fresh_s=0.0)
            self.waiting, self._counted = 0, False
            return
        self.waiting, self._counted = int(queue), True
        self.learned.upstream_load(self.waiting, fresh_s=3 * self.interval_s)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """Read them every ``interval_s``; return when the upstream publishes neither."""
        while True:
            try:
                async with session.get(self.url) as response:
                    text = await response.read()
                    status = response.status
                waiting = _WAITING.search(text)
                kv_usage = _KV_USAGE.search(text)
                if status == 404 or (status == 200 and waiting is None and kv_usage is None):
                    log.info(
                        "upstream publishes no queue length or KV-cache usage at %s; its "
                        "capacity is learned from first-byte times alone, and its memory "
                        "pressure is not seen",
                        self.url,
                    )
                    return
                queue = self._value(waiting)
                self._queue(queue)
                usage = self._value(kv_usage)
                if usage is not None:
                    self.kv_usage = min(1.0, max(0.0, usage))
                if queue is not None or usage is not None:
                    self.at = time.monotonic()
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("upstream metrics at %s unreadable: %s", self.url, exc)
            await asyncio.sleep(self.interval_s)
