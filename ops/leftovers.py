"""What an earlier ``laneway up`` left running when it was killed, stopped before anything
starts; and how long any stopping process of the stack gets after its SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from ingress.settings import IngressSettings
from laneway.settings import load_settings
from ops.supervised import Supervised, stray_services
from workers.settings import WorkerSettings

__all__ = ["process_runs", "stop_grace_s", "stop_leftovers"]

log = logging.getLogger(__name__)

# A stopping process gets at least this long after its SIGTERM before it is killed.
_SHORTEST_STOP_GRACE_S = 15.0
# What a stopping worker does after its drain (LANEWAY_DRAIN_GRACE_S): its last commit
# (bounded at 10 s), then it closes its Kafka and Redis clients and its engine.
_AFTER_DRAIN_S = 15.0
# What a stopping ingress does after its grace (LANEWAY_SHUTDOWN_GRACE_S): the tombstones of
# what it dropped (5 s at most), then it closes its clients.
_AFTER_INGRESS_GRACE_S = 5.0


def stop_leftovers(
    processes: Sequence[Supervised], log_dir: Path, grace_s: float = _SHORTEST_STOP_GRACE_S
) -> None:
    """What an earlier ``laneway up`` on the same data dir left running when it was killed
    (each child runs in a process group of its own, so a SIGKILL of the supervisor leaves
    them): stopped before anything starts, services before the servers they need, as its
    Ctrl-C would have. Only a process its pid file names and whose command line matches:
    one of ``processes``, or any laneway service with a pid file in ``log_dir`` (a worker
    replica the earlier stack ran and this one does not)."""
    left = {p.name: pid for p in processes if (pid := p.leftover_pid()) is not None}
    strays = stray_services(log_dir, {p.name for p in processes})
    left.update(strays)
    if not left:
        return
    log.warning(
        "an earlier laneway up here was killed and left %s running: stopping them first",
        ", ".join(f"{name} (pid {pid})" for name, pid in left.items()),
    )
    needed = {need for p in processes for need in p.needs}
    for wave in ([n for n in left if n not in needed], [n for n in left if n in needed]):
        for name in wave:
            with contextlib.suppress(ProcessLookupError):
                os.kill(left[name], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(process_runs(left[n]) for n in wave):
            time.sleep(0.1)
        for name in wave:
            if process_runs(left[name]):
                log.warning("%s (pid %d) ignored SIGTERM; killing it", name, left[name])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(left[name], signal.SIGKILL)
    for name in strays:  # no process of this stack goes by that name to remove it
        with contextlib.suppress(OSError):
            (log_dir / f"{name}.pid").unlink()


def stop_grace_s() -> float:
    """How long a stopping process gets after its SIGTERM before it is killed: enough for a
    worker's drain (LANEWAY_DRAIN_GRACE_S) or the ingress's grace (LANEWAY_SHUTDOWN_GRACE_S)
    and what follows it, and at least 15 s."""
    drain = load_settings(WorkerSettings).drain_grace_s
    ingress = load_settings(IngressSettings).shutdown_grace_s
    return max(_SHORTEST_STOP_GRACE_S, drain + _AFTER_DRAIN_S, ingress + _AFTER_INGRESS_GRACE_S)


def process_runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
