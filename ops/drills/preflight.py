"""What every drill does first and says as it goes: the stack must be ready, and each line
is printed as it happens (a drill runs for minutes)."""

from __future__ import annotations

import sys

import httpx

from laneway.errors import LanewayError

__all__ = ["check_ready", "say"]


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def check_ready(url: str) -> None:
    """Refuse to drill a stack that is not there or not ready, naming what to do."""
    try:
        response = httpx.get(f"{url}/readyz", timeout=5)
    except httpx.HTTPError as exc:
        raise LanewayError(
            f"no laneway ingress answers at {url} ({exc}); start the stack with `laneway up` "
            "(with the same LANEWAY_* ports) or pass --url"
        ) from exc
    if response.status_code != 200:
        raise LanewayError(f"the stack at {url} is not ready: {response.text}")
