"""The separate upstream server of the benches (``bench.upstream_server``) as a process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench._stack import ROOT, until_answering
from ops.devstack import stop_processes

__all__ = ["ServerProcess", "Upstream", "drain", "upstream_process"]


@dataclass(frozen=True)
class ServerProcess:
    """An OpenAI-compatible server a bench started: its port, the file it logs to, its pid."""

    port: int
    log: Path
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@dataclass(frozen=True)
class Upstream(ServerProcess):
    """``bench.upstream_server``: it logs every request's work."""

    def entries(self) -> list[dict[str, Any]]:
        """Every request it has ended, in the order they ended."""
        return [orjson.loads(line) for line in self.log.read_text().splitlines() if line]

    async def load(self, client: httpx.AsyncClient) -> tuple[int, int]:
        """Requests it runs and requests waiting in its queue now."""
        stats = (await client.get(f"http://127.0.0.1:{self.port}/stats")).json()
        return stats["running"], stats["waiting"]

    async def until_idle(self) -> None:
        await drain(self.port)


async def drain(port: int) -> None:
    """Until the upstream on ``port`` runs nothing: a window's stragglers never count in the
    next."""
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            stats = (await client.get(f"http://127.0.0.1:{port}/stats")).json()
            if stats["running"] == 0 and stats["waiting"] == 0:
                return
            await asyncio.sleep(0.1)


@contextmanager
def upstream_process(
    port: int, *, slots: int, token_ms: float, prefill_ms: float = 0.0, metrics: bool = False
) -> Iterator[Upstream]:
    """``bench.upstream_server`` on ``port``, logging to a throwaway file, until the block ends."""
    log = Path(tempfile.mkdtemp(prefix="laneway-upstream-")) / "upstream.jsonl"
    log.touch()
    argv = [
        sys.executable,
        "-m",
        "bench.upstream_server",
        f"--port={port}",
        f"--slots={slots}",
        f"--token-ms={token_ms}",
        f"--prefill-ms={prefill_ms}",
        f"--log={log}",
    ] + (["--metrics"] if metrics else [])
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/stats"
        until_answering(proc, url, within_s=20, every_s=0.1, what=f"the upstream on port {port}")
        yield Upstream(port, log, proc.pid)
    finally:
        stop_processes([proc])
