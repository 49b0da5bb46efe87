"""What every drill does first and says as it goes: the stack must be ready, and each line
is printed as it happens (a drill runs for minutes)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from laneway.errors import ConfigError, LanewayError

__all__ = ["check_ready", "output_path", "report", "say"]


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


def output_path(path: Path) -> Path:
    """``--out``: its directory made now, so that a path that cannot be written fails before
    the drill's minutes, not after them."""
    if path.is_dir():
        raise ConfigError(f"--out {path} is a directory: name the PNG file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--out {path}: cannot make {path.parent}: {exc.strerror or exc}"
        ) from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"--out {path}: permission denied")
    return path


def report(verdicts: str, write_timeline: Callable[[], Path]) -> None:
    """The drill's verdicts, then its timeline: a timeline that fails to be written (a disk
    gone full) still leaves the verdicts printed."""
    say(verdicts)
    try:
        say(f"\ntimeline: {write_timeline()}")
    except OSError as exc:
        say(f"\ntimeline not written: {exc}")
