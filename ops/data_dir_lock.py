"""One ``laneway up`` per data dir: a second one there is refused, naming the first."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from laneway.errors import ConfigError, ServiceError

__all__ = ["claimed"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def claimed(data: Path) -> Iterator[None]:
    """``data`` as this process's alone while inside: a second ``laneway up`` on the same data
    dir is refused, naming the first (a lock the kernel lets go when its holder dies, however
    it dies)."""
    try:
        data.mkdir(parents=True, exist_ok=True)
        lock_file = (data / "up.pid").open("a+")
    except OSError as exc:
        why = "it is not a directory" if data.exists() and not data.is_dir() else exc.strerror
        raise ConfigError(
            f"LANEWAY_DATA_DIR: {data} cannot hold the stack's data and logs ({why}); set "
            "LANEWAY_DATA_DIR to a directory laneway may create and write"
        ) from None
    with lock_file as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                # A filesystem without locks (some FUSE and NFS mounts): run unguarded.
                log.warning(
                    "%s cannot be locked (%s): a second laneway up there is not told",
                    lock.name,
                    exc.strerror,
                )
                yield
                return
            lock.seek(0)
            pid = lock.read().strip() or "unknown"
            raise ServiceError(
                f"laneway is already running on {data} (pid {pid}): Ctrl-C in its terminal, or "
                f"kill -INT {pid}, stops it; a second stack beside it needs a LANEWAY_DATA_DIR "
                "and ports of its own (LANEWAY_PORT, LANEWAY_KAFKA_PORT, LANEWAY_REDIS_PORT, "
                "LANEWAY_SUPERVISOR_PORT)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield
