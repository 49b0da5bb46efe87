"""The upstream's own ``/metrics``, read by the openai engine from a separate upstream process
(``bench.upstream_server``, serving what the test sets): every server's queue gauge is read,
and a bad value never stops the reading."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from tests.stack import eventually
from tests.upstream_process import UpstreamProcess
from workers.upstream import OpenAICompatibleEngine


@asynccontextmanager
async def _engine(
    upstream: UpstreamProcess, interval_s: float = 0.05
) -> AsyncIterator[OpenAICompatibleEngine]:
    metrics = upstream.url.removesuffix("/v1") + "/metrics"
    engine = OpenAICompatibleEngine(
        upstream.url, model="up", metrics_url=metrics, metrics_interval_s=interval_s
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    "text",
    [
        "llamacpp:requests_processing 4\nllamacpp:requests_deferred 2\n",
        'tgi_batch_current_size 4\ntgi_queue_size{model="m"} 2\n',
    ],
    ids=["llama.cpp", "tgi"],
)
async def test_llama_cpp_and_tgi_queue_gauges_are_read(
    upstreams: Callable[..., Any], text: str
) -> None:
    upstream = await upstreams(slots=4, token_ms=5, metrics=True)
    await upstream.metrics_text(text)
    async with _engine(upstream) as engine:
        await eventually(lambda: engine.stats().waiting == 2, 10, "the upstream's queue read")


async def test_an_infinite_or_nan_gauge_is_ignored_and_the_reading_goes_on(
    upstreams: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    upstream = await upstreams(slots=4, token_ms=5, metrics=True)
    await upstream.metrics_text("vllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc 0.5\n")
    with caplog.at_level(logging.WARNING, logger="workers.upstream_metrics"):
        async with _engine(upstream) as engine:
            # The rest of the reading counts.
            await eventually(lambda: engine.stats().kv_cache_usage == 0.5, 10, "the KV usage read")
            assert engine.stats().waiting == 0
            await upstream.metrics_text(
                "vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 0.25\n"
            )
            await eventually(
                lambda: engine.stats().kv_cache_usage == 0.25, 10, "the next KV usage read"
            )
            await upstream.metrics_text(
                "vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.75\n"
            )
            await eventually(lambda: engine.stats().waiting == 3, 10, "the queue read again")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "+Inf" in warnings[0].getMessage()


async def test_a_waiting_count_that_turns_unreadable_beside_a_readable_kv_gauge_is_no_count(
    upstreams: Callable[..., Any],
) -> None:
    """The waiting gauge turns NaN while the KV gauge still reads: the upstream's queue is
    then unknown, as for a server that publishes none. The last count must not be reported
    on as the queue, nor stay the only word on it (what first-byte stalls would say)."""
    upstream = await upstreams(slots=4, token_ms=5, metrics=True)
    await upstream.metrics_text("vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.5\n")
    # Read every second: a count stays fresh three readings, so the old one would still be
    # when the NaN is read.
    async with _engine(upstream, interval_s=1.0) as engine:
        await eventually(lambda: engine.stats().waiting == 3, 10, "the upstream's queue read")
        await upstream.metrics_text(
            "vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 0.25\n"
        )
        await eventually(lambda: engine.stats().kv_cache_usage == 0.25, 10, "the next reading")
        assert engine.stats().waiting == 0, "the last waiting count is still reported"
        assert not engine.learned._queue_known(time.monotonic()), (
            "the last waiting count is still the only word on the upstream's queue"
        )
