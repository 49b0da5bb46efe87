"""What ``laneway up`` serves on its metrics port (``LANEWAY_SUPERVISOR_PORT``): restarts and
up/down state per process, and each pool's replicas as its local autoscaler runs them."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from laneway.errors import ConfigError

__all__ = ["SupervisorMetrics"]


class SupervisorMetrics:
    """Restarts and up/down state per process, on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "laneway_supervisor_restarts_total",
            "Restarts of a process of `laneway up` after it exited",
            ["process"],
            registry=self.registry,
        )
        self.up = Gauge(
            "laneway_supervisor_process_up",
            "1 while a process of `laneway up` runs, 0 while it is down or restarting",
            ["process"],
            registry=self.registry,
        )
        self.replicas = Gauge(
            "laneway_local_replicas",
            "Worker processes of a pool that `laneway up` runs now (its local autoscaler)",
            ["pool"],
            registry=self.registry,
        )
        self.desired = Gauge(
            "laneway_local_desired_replicas",
            "The pool's scaling signal as `laneway up` obeys it (within its min and max)",
            ["pool"],
            registry=self.registry,
        )

    def serve(self, port: int) -> Callable[[], None]:
        """Serve ``/metrics`` on 127.0.0.1:``port``; returns the function that stops it."""
        try:
            server, thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"the supervisor's metrics port {port} is not free ({exc.strerror}); "
                "set LANEWAY_SUPERVISOR_PORT to a free port (0: no metrics)"
            ) from exc

        def close() -> None:
            server.shutdown()
            server.server_close()
            thread.join()

        return close
