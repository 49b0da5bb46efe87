"""A separate OpenAI-compatible upstream process for tests (``bench.upstream_server``).

It runs in its own process and writes its own log of what it ran, so a test judges the
shield by what the upstream did, not by what laneway says it did.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.stack import ROOT, free_port


class UpstreamProcess:
    def __init__(
        self,
        log: Path,
        *,
        slots: int,
        token_ms: float,
        metrics: bool = False,
        max_model_len: int = 0,
        end_ms: float = 0.0,
        prefill_ms: float = 0.0,
        cold_prefill_ms: float = 0.0,
        when_full: int = 0,
        retry_after: str = "",
        keepalive_ms: float = 0.0,
        tokens_always: int = 0,
        tokens_per_chunk: int = 1,
        silent_after_finish: bool = False,
        usage_apart_ms: float | None = None,
    ) -> None:
        self.log = log
        self.port = free_port()
        argv = [
            sys.executable,
            "-m",
            "bench.upstream_server",
            f"--port={self.port}",
            f"--slots={slots}",
            f"--token-ms={token_ms}",
            f"--log={log}",
            f"--max-model-len={max_model_len}",
            f"--end-ms={end_ms}",
            f"--prefill-ms={prefill_ms}",
            f"--cold-prefill-ms={cold_prefill_ms}",
            f"--when-full={when_full}",
            f"--retry-after={retry_after}",
            f"--keepalive-ms={keepalive_ms}",
            f"--tokens-always={tokens_always}",
            f"--tokens-per-chunk={tokens_per_chunk}",
        ]
        if metrics:
            argv.append("--metrics")
        if silent_after_finish:
            argv.append("--silent-after-finish")
        if usage_apart_ms is not None:
            argv.append(f"--usage-apart-ms={usage_apart_ms}")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def ready(self, within_s: float = 20.0) -> None:
        deadline = time.monotonic() + within_s
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    await client.get(self.url + "/models")
                except httpx.TransportError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the upstream process did not start") from None
                    await asyncio.sleep(0.05)
                else:
                    return

    async def queue(self) -> tuple[int, int]:
        """(running, waiting) on the upstream now, from its own metrics."""
        async with httpx.AsyncClient() as client:
            stats = (await client.get(f"http://127.0.0.1:{self.port}/stats")).json()
        return int(stats["running"]), int(stats["waiting"])

    async def until(
        self, holds: Callable[[int, int], bool], what: str, within_s: float = 20.0
    ) -> None:
        """Wait until ``holds(running, waiting)`` on the upstream."""
        deadline = time.monotonic() + within_s
        while not holds(*await self.queue()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {within_s}s waiting for {what}")
            await asyncio.sleep(0.02)

    async def metrics_text(self, text: str | None) -> None:
        """Serve ``text`` as ``/metrics`` (needs ``metrics=True``); None: its own again."""
        (await self.control("metrics_text", {"text": text})).raise_for_status()

    async def hold(self, *prompts: str) -> None:
        """Requests with these prompts keep their slot, before any token, until released."""
        await self._control("hold", prompts)

    async def release(self, *prompts: str) -> None:
        await self._control("release", prompts)

    async def held(self) -> list[str]:
        """The prompts held now (not released)."""
        return list((await self.control("hold", {"prompts": []})).json()["held"])

    async def _control(self, what: str, prompts: tuple[str, ...]) -> None:
        (await self.control(what, {"prompts": list(prompts)})).raise_for_status()

    async def control(self, what: str, body: object) -> httpx.Response:
        """``POST /hold``, ``/release`` or ``/metrics_text`` with ``body`` as it is, bad or not."""
        async with httpx.AsyncClient() as client:
            return await client.post(f"http://127.0.0.1:{self.port}/{what}", json=body)

    def entries(self) -> list[dict[str, Any]]:
        """What the upstream ran, one entry per request that has ended."""
        if not self.log.exists():
            return []
        return [orjson.loads(line) for line in self.log.read_text().splitlines() if line]

    def entry(self, prompt: str) -> dict[str, Any] | None:
        found = [e for e in self.entries() if prompt in e["prompt"]]
        return found[-1] if found else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
