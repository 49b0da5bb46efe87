"""compose/: the production topology, checked without a Docker engine.

The compose file against the Compose Specification schema; alert rules and scrape config with
promtool; the dashboard and the alert rules against the metrics laneway exports (read from
prometheus_client's registry); scrape targets, proxy upstreams and settings against the
services that exist.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from prometheus_client import REGISTRY

from ingress.settings import IngressSettings
from laneway.constants import POOLS
from laneway.settings import CommonSettings, known_variables
from ops.settings import StackSettings
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
SCHEMA = COMPOSE / "schema" / "compose-spec.json"
SCHEMA_SHA256 = "46b7d35f19dd93a05f8fea530291bf84d881c1791ec167ecf0e6fb94e639d496"
PROMETHEUS = COMPOSE / "prometheus"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "laneway.json"
PROVISIONING = COMPOSE / "grafana" / "provisioning"

# Modules that define laneway's metrics; the ones not written yet are simply absent.
METRICS_MODULES = (
    "ingress.metrics",
    "workers.metrics",
    "streams.metrics",
    "quota.metrics",
    "laneway.metrics",
)
# Labels Prometheus adds at scrape time (prometheus.yml's relabelling adds `service`).
TARGET_LABELS = {"job", "instance", "service"}
# Series of Prometheus itself that rules may use.
PROMETHEUS_SERIES = {"up"}

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("CI"),
    reason="promtool not installed: apt-get install -y prometheus (scripts/setup.sh --tests does)",
)


# --- loading ---------------------------------------------------------------------------------


@functools.cache
def compose() -> dict[str, Any]:
    with (COMPOSE / "docker-compose.yml").open() as f:
        doc: dict[str, Any] = yaml.safe_load(f)
    return doc


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*)|(:?\?)[^}]*)?\}")


def env(service: str) -> dict[str, str]:
    """The service's environment as Compose would set it with no variables given but the
    required ones (``${VAR:?...}``, the secrets of compose/.env), which read ``secret-VAR``."""
    environment = services()[service].get("environment") or {}

    def value(m: re.Match[str]) -> str:
        return f"secret-{m.group(1)}" if m.group(3) else m.group(2) or ""

    return {k: _INTERPOLATION.sub(value, str(v)) for k, v in environment.items()}


def laneway_services() -> dict[str, dict[str, Any]]:
    """Services running the laneway image (ingress, workers, streams, topic-init)."""
    return {
        name: svc
        for name, svc in services().items()
        if str(svc.get("image", "")).startswith("laneway")
    }


def exposed_ports(service: str) -> set[int]:
    svc = services()[service]
    ports = {int(str(p).split("/")[0]) for p in svc.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])}
    return ports


def promtool(*args: str, cwd: Path = PROMETHEUS) -> None:
    if shutil.which("promtool") is None:
        pytest.fail(
            "CI must have promtool: scripts/setup.sh --tests installs the Debian package prometheus"
        )
    done = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


@functools.cache
def exported_metrics() -> dict[str, frozenset[str]]:
    """Series names laneway exports (with the suffixes Prometheus sees) → their label names."""
    for module in METRICS_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise  # the module exists but one of its imports is missing
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    series: dict[str, frozenset[str]] = {}
    # The registry keeps label names only on the metric objects (no public accessor).
    for collector in REGISTRY._collector_to_names:
        kind, base = getattr(collector, "_type", None), getattr(collector, "_name", "")
        if kind not in suffixes or not base.startswith("laneway_"):
            continue
        labels = frozenset(collector._labelnames)
        series.update({base + suffix: labels for suffix in suffixes[kind]})
    return series


# --- PromQL, just enough to find metric and label names ----------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_GRAFANA_VARIABLES = re.compile(r"\$__(?:rate_interval|interval|range)")


def promql_names(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """(metric names, (metric, matcher labels) per selector, grouping labels) of ``expr``."""
    text = _STRING.sub('""', _GRAFANA_VARIABLES.sub("5m", expr))
    selectors = [
        (m.group(1) or "", set(_MATCHER_LABEL.findall(m.group(2))))
        for m in _SELECTOR.finditer(text)
    ]
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    grouping = {label.strip() for g in _GROUPING.findall(text) for label in g.split(",")}
    text = _RANGE.sub(" ", _GROUPING.sub(" ", text))
    names = {n for n in _IDENTIFIER.findall(text) if n.lower() not in _KEYWORDS}
    return names, selectors, grouping - {""}


def unknown_names_and_labels(expr: str) -> list[str]:
    """What ``expr`` uses that laneway does not export, one line per problem."""
    exported = exported_metrics()
    names, selectors, grouping = promql_names(expr)
    problems = [
        f"histogram {n} has no series of that name: use {n}_bucket, _sum or _count"
        if f"{n}_bucket" in exported
        else f"metric {n} is not exported"
        for n in sorted(names - set(exported) - PROMETHEUS_SERIES)
    ]
    known_labels = set(TARGET_LABELS)
    for name in names & set(exported):
        known_labels |= exported[name] | ({"le"} if name.endswith("_bucket") else set())
    for metric, labels in selectors:
        if metric in exported:
            own = exported[metric] | TARGET_LABELS
            problems += [f"{metric} has no label {lb}" for lb in sorted(labels - own)]
    if names <= set(exported) | PROMETHEUS_SERIES:  # else the missing metric is the news
        problems += [f"grouping by unknown label {lb}" for lb in sorted(grouping - known_labels)]
    return problems


def assert_no_problems(problems: dict[str, list[str]]) -> None:
    lines = [f"{where}: {'; '.join(found)}" for where, found in problems.items() if found]
    assert not lines, "queries use what laneway does not export:\n" + "\n".join(lines)


def laneway_names(expr: str) -> set[str]:
    return {n for n in promql_names(expr)[0] if n.startswith("laneway_")}


# --- the compose file ------------------------------------------------------------------------


def test_vendored_schema_is_the_recorded_one() -> None:
    digest = hashlib.sha256(SCHEMA.read_bytes()).hexdigest()
    assert digest == SCHEMA_SHA256, "compose/schema/compose-spec.json changed: see its README"


def test_compose_file_validates_against_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(compose())
    ]
    assert errors == []


def test_kafka_is_three_kraft_nodes_with_replication_factor_3_and_min_isr_2() -> None:
    brokers = sorted(n for n in services() if n.startswith("kafka-"))
    assert len(brokers) == 3
    settings = [env(b) for b in brokers]
    assert {s["KAFKA_NODE_ID"] for s in settings} == {"1", "2", "3"}
    assert len({s["CLUSTER_ID"] for s in settings}) == 1
    voters = {s["KAFKA_NODE_ID"]: f"{b}:9093" for b, s in zip(brokers, settings, strict=True)}
    for name, s in zip(brokers, settings, strict=True):
        assert services()[name]["image"].startswith("apache/kafka:")
        assert set(s["KAFKA_PROCESS_ROLES"].split(",")) >= {"broker", "controller"}
        assert dict(v.split("@") for v in s["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert f"INTERNAL://{name}:9092" in s["KAFKA_ADVERTISED_LISTENERS"]
        assert s["KAFKA_DEFAULT_REPLICATION_FACTOR"] == "3"
        assert s["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
        assert s["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "3"
        assert s["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "3"
        assert s["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
        assert s["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    for name in laneway_services():
        bootstrap = set(env(name)["LANEWAY_KAFKA_BOOTSTRAP"].split(","))
        assert bootstrap == {f"{b}:9092" for b in brokers}, name


def _settings_class(command: list[str]) -> type[CommonSettings] | None:
    if command[:3] == ["python", "-m", "ingress"]:
        return IngressSettings
    if command[:3] == ["python", "-m", "workers"]:
        return WorkerSettings
    if command[:2] == ["laneway", "topics"] or "laneway topics create" in " ".join(command):
        return StackSettings
    if command[:3] == ["python", "-m", "streams"]:
        try:
            module = importlib.import_module("streams.settings")
        except ModuleNotFoundError:
            return None  # not written yet: check against every known setting instead
        found = [
            c
            for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, CommonSettings) and c is not CommonSettings
        ]
        return found[0] if len(found) == 1 else None
    raise AssertionError(f"no settings class known for command {command}")


def test_every_laneway_setting_in_compose_is_read_by_its_service() -> None:
    unknown: dict[str, list[str]] = {}
    for name, svc in laneway_services().items():
        settings = _settings_class(svc["command"])
        known = (
            {f"LANEWAY_{f.upper()}" for f in settings.model_fields}
            if settings
            else known_variables()
        )
        if missing := sorted(v for v in env(name) if v.startswith("LANEWAY_") and v not in known):
            unknown[name] = missing
        elif settings:  # every value is one the service accepts
            settings(
                **{
                    k.removeprefix("LANEWAY_").lower(): v
                    for k, v in env(name).items()
                    if k in known
                }
            )
    assert not unknown, f"services that would refuse to start (no such setting): {unknown}"


def test_worker_pools_reserve_a_gpu_and_run_vllm() -> None:
    for pool in POOLS:
        [name] = [
            n
            for n, s in services().items()
            if s.get("command", [])[:3] == ["python", "-m", "workers"] and pool in s["command"]
        ]
        svc, settings = services()[name], env(name)
        assert svc["command"][-2:] == ["--pool", pool]
        assert settings["LANEWAY_POOL"] == pool
        assert settings["LANEWAY_ENGINE"] == "vllm"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), name
        grace = float(settings.get("LANEWAY_DRAIN_GRACE_S", WorkerSettings().drain_grace_s))
        # After the drain: the last commit (up to 10 s), then its clients and engine close
        # (`laneway up` allows drain + 15 s, ops/leftovers.py).
        assert _seconds(svc["stop_grace_period"]) >= grace + 15, f"{name}: its stop is cut short"


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, f"unexpected duration {duration!r}"
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def test_topic_init_creates_topics_before_any_laneway_service_starts() -> None:
    init = services()["topic-init"]
    assert init["command"][-1].startswith("laneway topics create\n")
    assert init["restart"] == "no"
    assert env("topic-init")["LANEWAY_REPLICATION_FACTOR"] == "3"
    assert set(init["depends_on"]) == {n for n in services() if n.startswith("kafka-")}
    for name, svc in laneway_services().items():
        if name != "topic-init":
            assert svc["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"


def _vllm_requirement() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return next(r for r in extras if r.startswith("vllm"))


def test_dockerfile_builds_the_images_compose_names() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", dockerfile, re.MULTILINE | re.I))
    assert next(iter(stages)) == "python:3.11-slim"
    # At the versions the suite passed on: constraints.txt is sent with the context.
    assert "pip install -c constraints.txt ." in dockerfile
    assert "!constraints.txt" in (COMPOSE / "Dockerfile.dockerignore").read_text().split()
    vllm = re.search(r"^ARG VLLM_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert vllm is not None
    # The version the vllm extra allows (pyproject.toml), not one beyond it.
    assert Requirement(_vllm_requirement()).specifier.contains(vllm.group(1)), vllm.group(1)
    for name, svc in laneway_services().items():
        build = svc["build"]
        assert (COMPOSE / build["context"] / build["dockerfile"]).resolve() == (
            COMPOSE / "Dockerfile"
        ), name
        assert build["target"] in stages.values(), name


# --- the proxy -------------------------------------------------------------------------------


def nginx_directives(text: str) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """(enclosing blocks, directive words) of an nginx config, comments dropped."""
    blocks: list[str] = []
    words: list[str] = []
    for token in re.findall(r'"[^"]*"|[{};]|[^\s{};"]+', re.sub(r"#[^\n]*", "", text)):
        if token == "{":
            blocks.append(" ".join(words))
            words = []
        elif token == "}":
            blocks.pop()
        elif token == ";":
            yield tuple(blocks), words
            words = []
        else:
            words.append(token)


def test_proxy_balances_both_ingress_replicas_and_streams_sse() -> None:
    conf = list(nginx_directives((COMPOSE / "nginx" / "nginx.conf").read_text()))
    upstream = {w[1] for b, w in conf if b and b[-1].startswith("upstream") and w[0] == "server"}
    ingress = [n for n, s in services().items() if s.get("command") == ["python", "-m", "ingress"]]
    assert len(ingress) == 2
    assert upstream == {f"{n}:{env(n)['LANEWAY_PORT']}" for n in ingress}
    assert len({env(n)["LANEWAY_INSTANCE_ID"] for n in ingress}) == 2, "reply streams collide"
    proxied = {w[0]: w[1:] for b, w in conf if b and b[-1] == "location /"}
    assert proxied["proxy_buffering"] == ["off"]
    assert proxied["proxy_request_buffering"] == ["off"]
    assert proxied["proxy_http_version"] == ["1.1"]
    assert proxied["proxy_ignore_client_abort"] == ["off"], "client disconnects must cancel"
    read_timeout = _seconds(proxied["proxy_read_timeout"][0])
    assert read_timeout > IngressSettings().reply_timeout_s
    listen = [w[1] for b, w in conf if w[0] == "listen"]
    assert listen == ["8000"]
    assert any(p.endswith(":8000") for p in services()["proxy"]["ports"])


def test_the_public_proxy_passes_no_admin_route() -> None:
    conf = list(nginx_directives((COMPOSE / "nginx" / "nginx.conf").read_text()))
    for path in ("/admin", "/console"):  # the admin API and its web console
        refused = [w for b, w in conf if b and b[-1] == f"location ^~ {path}"]
        assert refused == [["return", "404"]], f"the proxy must answer {path} itself"
        # No other location may serve these paths (a regex location would win over "/").
        others = [b[-1] for b, _ in conf if b and b[-1].startswith("location") and path in b[-1]]
        assert set(others) == {f"location ^~ {path}"}
    assert not [b for b, _ in conf if b and b[-1].startswith("location ~")]


# --- Prometheus ------------------------------------------------------------------------------


def scrape_targets() -> dict[str, list[tuple[str, int]]]:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    targets: dict[str, list[tuple[str, int]]] = {}
    for job in config["scrape_configs"]:
        found = targets.setdefault(job["job_name"], [])
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                found.append((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            found += [(name, int(dns["port"])) for name in dns["names"]]
    return targets


def test_prometheus_scrapes_every_laneway_service_on_a_port_it_exposes() -> None:
    targets = scrape_targets()
    scraped = {host for found in targets.values() for host, _ in found}
    long_running = set(laneway_services()) - {"topic-init"}
    assert long_running <= scraped, f"not scraped: {sorted(long_running - scraped)}"
    for job, found in targets.items():
        for host, port in found:
            if host == "localhost":
                assert job == "prometheus"
                continue
            assert host in services(), f"{job}: no compose service {host}"
            assert port in exposed_ports(host), f"{job}: {host} does not expose {port}"


@needs_promtool
def test_promtool_accepts_the_config_and_the_alert_rules() -> None:
    promtool("check", "config", "prometheus.yml")
    promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    promtool("test", "rules", "alerts.test.yml")


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_cover_breaker_lag_probe_and_quota_fallback() -> None:
    exprs = [" ".join(r["expr"].split()) for r in alert_rules()]
    assert any("laneway_breaker_level" in e and ">= 2" in e for e in exprs)
    assert any("laneway_consumer_lag" in e and "deriv(" in e for e in exprs)
    assert any("laneway_probe_success" in e and "== 0" in e for e in exprs)
    assert any("laneway_quota_fallback_active" in e for e in exprs)


def test_alert_rules_use_only_exported_metrics_and_labels() -> None:
    problems = {r["alert"]: unknown_names_and_labels(r["expr"]) for r in alert_rules()}
    assert_no_problems(problems)


# --- Grafana ---------------------------------------------------------------------------------


def dashboard_panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return [p for p in panels if p["type"] not in ("row", "text")]


def dashboard_queries() -> dict[str, str]:
    """'panel title / refId' → PromQL, the template variable queries included."""
    queries = {
        f"{p['title']} / {t['refId']}": t["expr"] for p in dashboard_panels() for t in p["targets"]
    }
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"variable {var['name']}: unexpected query {query}"
            queries[f"variable {var['name']}"] = f"count by ({match.group(2)}) ({match.group(1)})"
    return queries


def test_dashboard_loads_and_every_query_names_an_exported_metric() -> None:
    assert dashboard_panels(), "the dashboard has no panels"
    problems = {
        where: unknown_names_and_labels(expr)
        if laneway_names(expr)
        else ["names no laneway metric"]
        for where, expr in dashboard_queries().items()
    }
    assert_no_problems(problems)


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = [
        {"record": f"laneway:dashboard_query_{i}", "expr": _GRAFANA_VARIABLES.sub("5m", expr)}
        for i, expr in enumerate(dashboard_queries().values())
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]})
    )
    promtool("check", "rules", "queries.yml", cwd=tmp_path)


def test_dashboard_shows_what_operators_need() -> None:
    panels = dashboard_panels()
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert any(p["type"] == "heatmap" and "engine_ms" in str(p["targets"]) for p in panels)
    assert "histogram_quantile(0.99," in exprs
    assert "histogram_quantile(0.999," in exprs
    for metric in (
        "laneway_cost_total",
        "laneway_breaker_level",
        "laneway_quota_remaining_tokens",
        "laneway_consumer_lag",
        "laneway_probe_success",
        "laneway_stale_engine_ms_total",
    ):
        assert metric in exprs, f"no panel shows {metric}"
    assert re.search(r'laneway_requests_total\{status=~"[^"]*superseded', exprs), "drops by reason"


def test_grafana_is_provisioned_with_the_compose_prometheus_and_the_dashboard_folder() -> None:
    [source] = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    host, port = source["url"].removeprefix("http://").split(":")
    assert host in services()
    assert int(port) in exposed_ports(host)
    uids = {p["datasource"]["uid"] for p in dashboard_panels()}
    uids |= {t["datasource"]["uid"] for p in dashboard_panels() for t in p["targets"]}
    assert uids == {source["uid"]}
    [provider] = yaml.safe_load((PROVISIONING / "dashboards" / "laneway.yml").read_text())[
        "providers"
    ]
    mounts = dict(v.split(":")[:2][::-1] for v in services()["grafana"]["volumes"])
    assert (COMPOSE / mounts[provider["options"]["path"]]).resolve() == DASHBOARD.parent


# --- Kafka and Redis as trust boundaries (docs/security.md) ------------------------------


def test_every_kafka_listener_asks_for_a_login_and_acls_decide() -> None:
    for name in (n for n in services() if n.startswith("kafka-")):
        s = env(name)
        protocols = dict(p.split(":") for p in s["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        listeners = [lst.split("://")[0] for lst in s["KAFKA_LISTENERS"].split(",")]
        assert {protocols[lst] for lst in listeners} <= {"SASL_PLAINTEXT", "SASL_SSL"}, name
        assert s["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
        assert s["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
        assert s["KAFKA_SUPER_USERS"] == "User:admin"
        for listener in listeners:
            mechanisms = s[f"KAFKA_LISTENER_NAME_{listener}_SASL_ENABLED_MECHANISMS"].split(",")
            for mechanism in mechanisms:
                key = mechanism.replace("-", "___")
                assert f"KAFKA_LISTENER_NAME_{listener}_{key}_SASL_JAAS_CONFIG" in s, (
                    name,
                    listener,
                    mechanism,
                )


def test_each_laneway_service_logs_in_as_its_own_principal_and_redis_user() -> None:
    seen: dict[str, str] = {}
    for name, svc in laneway_services().items():
        s = env(name)
        assert s["LANEWAY_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT", name
        assert "@redis:6379" in s["LANEWAY_REDIS_URL"], f"{name}: Redis without a user"
        user = s["LANEWAY_KAFKA_USERNAME"]
        if name == "topic-init":
            assert user == "admin"
            continue
        command = svc["command"]
        pool = command[-1] if "--pool" in command else ""
        expected = f"worker-{pool}" if pool else command[2]
        assert user == expected, name
        raw = services()[name]["environment"]
        # The password comes from compose/.env, never from this file.
        assert str(raw["LANEWAY_KAFKA_PASSWORD"]).startswith("${"), name
        seen[name] = user
    # topic-init creates exactly the principals the services log in as.
    script = services()["topic-init"]["command"][-1]
    for user in set(seen.values()):
        assert f"{user}:" in script, user


def test_redis_reads_its_users_from_the_file_compose_secrets_writes(tmp_path: Path) -> None:
    redis = services()["redis"]
    command = redis["command"]
    acl = command[command.index("--aclfile") + 1]
    assert f"./redis/users.acl:{acl}:ro" in redis["volumes"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compose_secrets.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "redis" / "users.acl").read_text().splitlines()
    assert lines[0].startswith("user default off")
    names = {line.split()[1] for line in lines[1:]}
    users = {env(n)["LANEWAY_REDIS_URL"].split("//")[1].split(":")[0] for n in laneway_services()}
    assert users <= names
    dotenv = (tmp_path / ".env").read_text()
    referenced = set(re.findall(r"\$\{(\w+):\?", (COMPOSE / "docker-compose.yml").read_text()))
    assert referenced <= {line.split("=")[0] for line in dotenv.splitlines()}
    for line in dotenv.splitlines():
        assert line.split("=", 1)[1] not in (tmp_path / "redis" / "users.acl").read_text()
