"""What ``laneway up`` serves on its metrics port (``LANEWAY_SUPERVISOR_PORT``): restarts and
up/down state per process, each pool's replicas as its local autoscaler runs them, and every
running service's own series, labelled with its process."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from laneway.errors import ConfigError

__all__ = ["ServiceMetrics", "SupervisorMetrics"]

log = logging.getLogger(__name__)

# One service that does not answer in time is left out of a scrape, not the scrape itself.
_SCRAPE_TIMEOUT_S = 2.0


class ServiceMetrics(Collector):
    """The series of every running service (``targets``: its process name and metrics URL),
    read when the supervisor's /metrics is, each sample with a ``process`` label: the
    workers and the streams app serve theirs on ports of their own, which a user of
    ``laneway up`` never set, and each replica's series would otherwise collide."""

    def __init__(self, targets: Callable[[], Iterable[tuple[str, str]]]) -> None:
        self.targets = targets

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for process, url in self.targets():
            try:
                with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_S) as response:  # noqa: S310 - a URL the supervisor made
                    text = response.read().decode()
                parsed = list(text_string_to_metric_families(text))
            except (OSError, ValueError) as exc:  # down, restarting, or not serving yet
                log.debug("metrics of %s not read: %s", process, exc)
                continue
            for family in parsed:
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples.extend(
                    sample._replace(labels={**sample.labels, "process": process})
                    for sample in family.samples
                )
        yield from families.values()


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
