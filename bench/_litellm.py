"""LiteLLM's proxy as a process, the peer the CPU bench measures laneway beside; installed on
demand into a venv of its own, so laneway's environment never depends on it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench._stack import until_answering
from ops.devstack import stop_processes

LITELLM_PORT = 31895
LITELLM_VENV = Path.home() / ".cache" / "laneway" / "litellm-venv"
LITELLM_KEY = "sk-laneway-bench"


@contextmanager
def litellm_proxy(workers: int, upstream_port: int) -> Iterator[int]:
    """LiteLLM's proxy on LITELLM_PORT in front of the upstream on ``upstream_port`` (as model
    ``up``); yields its pid."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if not binary.exists():
        print(f"# installing LiteLLM into {LITELLM_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True
        )
    config = Path(tempfile.mkdtemp(prefix="laneway-litellm-")) / "config.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: up\n"
        "    litellm_params:\n"
        "      model: openai/up\n"
        f"      api_base: http://127.0.0.1:{upstream_port}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    # Its proxy wants a master key (clients send it, as laneway's send theirs), and would
    # fetch a model price map from the internet at start.
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_MASTER_KEY": LITELLM_KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    proc = subprocess.Popen(
        [
            str(binary),
            "--config",
            str(config),
            "--port",
            str(LITELLM_PORT),
            "--num_workers",
            str(workers),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{LITELLM_PORT}/health/liveliness"
        until_answering(proc, url, within_s=120, every_s=0.5, what="LiteLLM's proxy")
        yield proc.pid
    finally:
        stop_processes([proc])
