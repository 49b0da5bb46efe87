"""Local servers (Kafka, Redis) as child processes of ours, for `make up`, the test session and
the drills: the process, its log and pid file, its port, its start and stop.

Both servers run as child processes in their own session, so a Ctrl-C in the terminal reaches
only our CLI, which then stops workers first and the servers last.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar

from laneway.errors import ServiceError

__all__ = [
    "LOG_TAIL_LINES",
    "ServerProcess",
    "ServiceError",
    "StartedInside",
    "port_in_use",
    "run_sync",
    "run_tool",
    "stop_processes",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

LOG_TAIL_LINES = 40
_POLL_S = 0.25


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM every process still running, give them ``grace_s`` to drain, then kill."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_in_use(port: int) -> bool:
    """True if something already listens on (or holds) 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same flag as redis and the JVM use, so a port in TIME_WAIT still counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion, on a helper thread if this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run_tool(argv: list[str], timeout_s: float, what: str) -> subprocess.CompletedProcess[str]:
    """Run a setup tool to its end, its output captured; ``ServiceError`` saying ``what`` did
    not finish if it runs past ``timeout_s`` (it is killed)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(
            f"{what} did not finish within {timeout_s:.0f} s; it was stopped ({' '.join(argv)})"
        ) from exc


class StartedInside:
    """``with server:`` starts it and stops it after the block."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ServerProcess(StartedInside):
    """A child server process: log file, port guard, stop with SIGTERM then SIGKILL."""

    name = "server"
    port_setting = "LANEWAY_PORT"
    # Found in /proc/<pid>/cmdline of our server (redis-server rewrites its argv).
    cmdline_marker = b"server"

    def __init__(self, *, port: int, data_dir: Path) -> None:
        self.port = port
        self.data_dir = data_dir
        self._process: subprocess.Popen[bytes] | None = None
        # The latest run, kept after stop() lets go of it: wait() and signals still reach it.
        self._spawned: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0

    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    @property
    def _pid_path(self) -> Path:
        return self.data_dir / f"{self.name}.pid"

    def leftover_pid(self) -> int | None:
        """The pid of a run of this server that its pid file names and that still runs (its
        command line says so): one an earlier run left behind, if this one did not start it."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self._pid_path.read_text())
            if self.runs_here(pid):
                return pid
        return None

    def runs_here(self, pid: int) -> bool:
        """Whether process ``pid`` is this server: its command line names the server and it
        runs in this data dir (where ``_spawn`` starts it), not another stack's, or the
        system's, that got the pid of a stale pid file since."""
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        return self.cmdline_marker in cmdline and cwd == self.data_dir.resolve()

    def _check_port_free(self, port: int, what: str) -> None:
        if not port_in_use(port):
            return
        hint = ""
        pid = self.leftover_pid()
        if pid is not None:
            hint = f"; a {self.name} from an earlier run (pid {pid}) still holds it: kill {pid}"
        raise ServiceError(
            f"{what} port {port} is already in use{hint}; "
            f"set {self.port_setting} to a free port or stop whatever listens there"
        )

    def _spawn(self, argv: list[str]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log_start = self._log.tell()
        try:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        except OSError as exc:
            self.stop()
            raise ServiceError(f"could not run {argv[0]}: {exc}") from exc
        self._spawned = self._process
        self._pid_path.write_text(str(self._process.pid))
        log.info(
            "started %s (pid %d) on port %d, log %s",
            self.name,
            self._process.pid,
            self.port,
            self.log_path,
        )

    def log_tail(self) -> str:
        """The last lines this server wrote since it was last started."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_start)
                lines = fh.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def _wait_ready(self, timeout: float) -> None:
        try:
            self._poll_until_ready(timeout)
        except BaseException:
            # Also on Ctrl-C: a half-started server must not outlive us in its own session.
            self.stop()
            raise

    def _poll_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error = "not probed yet"
        while True:
            if self._process is None:
                raise ServiceError(f"{self.name} was stopped while starting")
            code = self._process.poll()
            if code is not None:
                raise ServiceError(
                    f"{self.name} exited with code {code} while starting; "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            ready, last_error = self._probe()
            if ready:
                return
            if time.monotonic() >= deadline:
                raise ServiceError(
                    f"{self.name} on port {self.port} was not ready after {timeout:.0f}s "
                    f"(last probe: {last_error}); {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def _probe(self) -> tuple[bool, str]:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def wait(self) -> int:
        """Block until the latest run exits and return its exit code (-N: signal N)."""
        process = self._spawned
        if process is None:
            raise ServiceError(f"{self.name} was never started")
        return process.wait()

    def send_signal(self, signum: int) -> None:
        """Signal the latest run if it still runs, stopping or not (a no-op otherwise)."""
        process = self._spawned
        if process is not None and process.poll() is None:
            process.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop with SIGTERM, then SIGKILL after ``timeout`` seconds; safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "%s (pid %d) ignored SIGTERM for %.0fs; killing it",
                        self.name,
                        process.pid,
                        timeout,
                    )
                    process.kill()
                    process.wait()
            log.info("stopped %s (pid %d, exit %s)", self.name, process.pid, process.returncode)
            with contextlib.suppress(OSError):
                self._pid_path.unlink()
        if self._log is not None:
            self._log.close()
            self._log = None
