"""The processes ``laneway up`` supervises, behind one small interface: a laneway service
(``python -m ingress``, a worker, the streams app) or a local server (Kafka, Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol, TextIO

__all__ = [
    "LOG_TAIL_LINES",
    "SERVICE_MODULES",
    "LocalServer",
    "ServiceProcess",
    "Supervised",
    "prefixed_echo",
    "stray_services",
]

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
# Output is copied in chunks; a "line" longer than this is passed on in pieces.
_LONGEST_LINE = 64 * 1024
# A process that exited has written everything it will; a grandchild holding the pipe open
# must not keep its supervisor waiting for the end of the output.
_OUTPUT_DRAIN_S = 2.0
# The laneway services, each run as `python -m <module>`.
SERVICE_MODULES = ("ingress", "workers", "streams")


class Supervised(Protocol):
    """One process the supervisor starts, watches, restarts and stops."""

    name: str
    needs: tuple[str, ...]  # names of processes that must be up before this one (re)starts
    # Where its current run serves its Prometheus metrics (the supervisor's /metrics serves
    # them under a ``process`` label), or None.
    metrics_url: str | None
    # The front door (the ingress): stopped first and alone, so that it finishes the requests
    # it has open while the services that answer them still run.
    front: bool

    @property
    def pid(self) -> int | None: ...

    @property
    def alive_file(self) -> Path | None:
        """The file its current run touches every second while its event loop runs (its
        watchdog), or None if it gives no sign of life but its exit."""

    @property
    def log_path(self) -> Path: ...

    async def start(self) -> None:
        """Start it: return once it runs (a server: once it serves), or raise
        ``ServiceError`` (or ``OSError`` if it cannot be run at all)."""

    async def wait(self) -> int:
        """Until the current run exits: its exit code (-N: killed by signal N)."""

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; safe when it does not run."""

    def kill(self) -> None:
        """SIGKILL now, if it runs."""

    def log_tail(self) -> str:
        """The last lines the current (or last) run wrote."""

    def leftover_pid(self) -> int | None:
        """A run of this process that an earlier supervisor started and left running (its pid
        file names it and its command line matches), else None."""


def _free_port() -> int:
    """A port nothing listens on now (the OS's pick), for a child to serve its metrics on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def prefixed_echo(name: str, width: int, out: TextIO | None = None) -> Callable[[str], None]:
    """Print a child's output line as ``name | line`` (names padded to ``width``)."""

    def echo(line: str) -> None:
        stream = out or sys.stdout
        stream.write(f"{name:<{width}} | {line}\n")
        stream.flush()

    return echo


class ServiceProcess:
    """A laneway service as a child process: its output goes to ``<log_dir>/<name>.log``,
    to ``echo`` (the terminal), and its last lines to a ring buffer for crash reports. With
    ``watchdog``, it is told (LANEWAY_WATCHDOG_FILE) to touch ``<log_dir>/<name>.alive``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        log_dir: Path,
        needs: Sequence[str] = (),
        echo: Callable[[str], None] | None = None,
        front: bool = False,
        watchdog: bool = False,
        metrics_url: str | None = None,
        serve_metrics: bool = False,
    ) -> None:
        """``metrics_url``: where it serves its metrics (the ingress, on its own port);
        ``serve_metrics``: told to serve them (LANEWAY_METRICS_PORT) on a port free when
        each run starts."""
        self.name = name
        self.metrics_url = metrics_url
        self._serve_metrics = serve_metrics
        self.needs = tuple(needs)
        self.front = front
        self.argv = list(argv)
        self.log_dir = log_dir
        self._alive_file = log_dir / f"{name}.alive" if watchdog else None
        # Unbuffered: a line printed just before a crash must reach the log.
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        if self._alive_file is not None:
            self.env["LANEWAY_WATCHDOG_FILE"] = str(self._alive_file)
        self._echo = echo
        self._log_failing = False
        self._lines: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._process: asyncio.subprocess.Process | None = None
        self._output: asyncio.Task[None] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        return self.log_dir / f"{self.name}.pid"

    @property
    def alive_file(self) -> Path | None:
        return self._alive_file

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._lines.clear()
        if self._serve_metrics:
            port = _free_port()
            self.env["LANEWAY_METRICS_PORT"] = str(port)
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        log_file = self.log_path.open("ab")
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Its own process group: a Ctrl-C reaches the supervisor alone, which then
                # stops the services before the servers they need.
                process_group=0,
            )
        except OSError:
            log_file.close()
            raise
        process = self._process
        try:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log_file.write(f"----- {stamp} started pid {process.pid} -----\n".encode())
            self.pid_path.write_text(str(process.pid))
        except BaseException:
            # A start that raises leaves no child behind: nobody would watch or stop it (its
            # pid file, if written, names a dead process).
            try:
                self.kill()
                await process.wait()
            finally:
                log_file.close()
            raise
        if process.stdout is not None:  # always, with stdout=PIPE
            self._output = asyncio.create_task(self._copy_output(process.stdout, log_file))

    async def _copy_output(self, stream: asyncio.StreamReader, log_file: IO[bytes]) -> None:
        # Read to the end whatever fails: a pipe nobody reads fills, the service blocks in
        # its next print (its event loop with it, deaf to SIGTERM), and the wait for its
        # exit, which waits for the pipe to close too, never ends: a stop hung for good.
        pending = b""
        try:
            while chunk := await stream.read(65536):
                self._log(log_file, chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                if len(pending) > _LONGEST_LINE:
                    lines.append(pending)
                    pending = b""
                for line in lines:
                    self._emit(line)
            if pending:
                self._emit(pending)
        finally:
            with contextlib.suppress(OSError):
                log_file.close()

    def _log(self, log_file: IO[bytes], chunk: bytes) -> None:
        """``chunk`` into the log file; a full disk or a read-only one loses the chunk, said
        once until a write succeeds again."""
        try:
            log_file.write(chunk)
            log_file.flush()
        except (OSError, ValueError) as exc:
            if not self._log_failing:
                self._log_failing = True
                log.error(  # noqa: TRY400 - the error says it all, a traceback nothing more
                    "%s: cannot write its log %s (%s): its output is lost there until a "
                    "write succeeds (its last lines are kept for a crash report)",
                    self.name,
                    self.log_path,
                    exc,
                )
            return
        if self._log_failing:
            self._log_failing = False
            log.warning("%s: its log %s is written again", self.name, self.log_path)

    def _emit(self, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r")
        self._lines.append(text)
        if self._echo is not None:
            try:
                self._echo(text)
            except BlockingIOError:
                pass  # a terminal that is full for now: this line is not shown there
            except (OSError, ValueError):
                # The terminal hung up (EIO), a `| tee` died (EPIPE): nothing to echo to.
                self._echo = None

    async def wait(self) -> int:
        process = self._process
        if process is None:
            raise RuntimeError(f"{self.name} was never started")
        code = await process.wait()
        output = self._output
        if output is not None:
            done, _ = await asyncio.wait({output}, timeout=_OUTPUT_DRAIN_S)
            if not done:
                output.cancel()
        return code

    async def stop(self, grace_s: float) -> None:
        process = self._process
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), grace_s)
            except TimeoutError:
                log.warning(
                    "%s (pid %d) still runs after %.0fs; killing it",
                    self.name,
                    process.pid,
                    grace_s,
                )
                self.kill()
        await self.wait()
        for path in (self.pid_path, self._alive_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()

    def kill(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            # Its whole process group: a child of its own (vLLM's engine core) outlives a
            # SIGKILL of its parent alone, and would hold the GPU the restart needs.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                # No group to signal: the process alone, if it still runs. Not both:
                # Popen.kill polls first and may reap it, and asyncio's own wait would
                # then report an exit code of 255 for a killed process.
                with contextlib.suppress(ProcessLookupError):
                    process.kill()

    def log_tail(self) -> str:
        return "\n".join(self._lines)

    def leftover_pid(self) -> int | None:
        if self._process is not None:
            return None  # this supervisor's own
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_path.read_text())
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if [a.encode() for a in self.argv[1:]] != args[1 : len(self.argv)]:
                return None
            # A pid used again since, by another stack's service of the same command line
            # (a second stack, the test suite's), has another watchdog file: not ours to stop.
            if self._alive_file is None or _runs_a_service(pid, self._alive_file):
                return pid
        return None


def stray_services(log_dir: Path, known: Collection[str]) -> dict[str, int]:
    """Laneway services that an earlier supervisor started with ``log_dir`` under names not
    in ``known`` (a worker replica the configuration no longer has) and left running: name
    and pid, from their pid files, where the process runs ``<python> -m <service>`` with
    the watchdog file this ``log_dir`` gave it (a pid used again since, by another stack's
    service, is not one)."""
    found = {}
    for pid_file in sorted(log_dir.glob("*.pid")):
        if pid_file.stem in known:
            continue
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            if _runs_a_service(pid, log_dir / f"{pid_file.stem}.alive"):
                found[pid_file.stem] = pid
    return found


def _runs_a_service(pid: int, alive_file: Path) -> bool:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if not (
        len(args) >= 3
        and os.path.basename(args[0]).startswith(b"python")
        and args[1] == b"-m"
        and args[2] in {module.encode() for module in SERVICE_MODULES}
    ):
        return False
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return f"LANEWAY_WATCHDOG_FILE={alive_file}".encode() in environ


class _Server(Protocol):
    """What the local servers offer (``ops.kafka_broker``, ``ops.redis_server``: start and
    stop block until done)."""

    name: str

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...

    def wait(self) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def log_tail(self) -> str: ...

    def leftover_pid(self) -> int | None: ...


class LocalServer:
    """Kafka or Redis (``ops.kafka_broker``, ``ops.redis_server``) as a supervised process;
    its blocking start, wait and stop run on threads. ``on_ready`` runs after every start
    (e.g. topic creation).

    It gives the supervisor no sign of life but its exit: a hung broker or Redis is not
    killed (a probe would be a Kafka or Redis client of the supervisor's, on a thread, and
    the services' own timeouts and fallbacks already bridge a server that stalls)."""

    needs: tuple[str, ...] = ()
    front = False
    alive_file: Path | None = None
    metrics_url: str | None = None

    def __init__(self, server: _Server, *, on_ready: Callable[[], None] | None = None) -> None:
        self.server = server
        self.name = server.name
        self._on_ready = on_ready

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        self.server.stop()  # reaps a run that died and closes its log; no-op the first time
        self.server.start()
        if self._on_ready is not None:
            self._on_ready()

    async def wait(self) -> int:
        return await asyncio.to_thread(self.server.wait)

    async def stop(self, grace_s: float) -> None:
        await asyncio.to_thread(self.server.stop, grace_s)

    def kill(self) -> None:
        self.server.send_signal(signal.SIGKILL)

    def log_tail(self) -> str:
        return self.server.log_tail()

    def leftover_pid(self) -> int | None:
        return None if self.server.pid is not None else self.server.leftover_pid()
