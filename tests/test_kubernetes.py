"""compose/kubernetes/: every manifest passes kubeconform (strict, Kubernetes and KEDA
schemas, offline), and agrees with laneway: settings, pools, scaling signal, partitions."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ingress.settings import IngressSettings
from laneway.constants import POOLS, Topics
from ops.settings import StackSettings
from streams.settings import StreamsSettings
from workers.scaling import DESIRED_REPLICAS
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "compose" / "kubernetes"
MANIFESTS = ("base", "keda", "hpa")
KUBECONFORM = ROOT / "scripts" / "kubeconform.sh"
KEDA_SCHEMA = KUBE / "schema" / "keda.sh" / "scaledobject_v1alpha1.json"
KEDA_SCHEMA_SHA256 = "85630b3fa32576e4c1cc90aa5fe86dda0970b91e5e146f65c7263bf793295c73"
# The settings class of each laneway container, by the module it runs.
SETTINGS = {
    "ingress": IngressSettings,
    "workers": WorkerSettings,
    "streams": StreamsSettings,
    "topics": StackSettings,
}


@functools.cache
def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file relative to compose/kubernetes, resource) of every manifest."""
    found = []
    for path in sorted(p for folder in MANIFESTS for p in (KUBE / folder).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((str(path.relative_to(KUBE)), doc))
    return found


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


def kubeconform(*args: str) -> dict[str, Any]:
    run = subprocess.run(
        [str(KUBECONFORM), "-output", "json", "-verbose", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode == 3 and not os.environ.get("CI"):
        pytest.skip(run.stderr.strip())
    result: dict[str, Any] = json.loads(run.stdout)
    return result


def test_every_manifest_passes_kubeconform_strictly() -> None:
    result = kubeconform(*(f"compose/kubernetes/{folder}" for folder in MANIFESTS))
    statuses = {(r["filename"], r["kind"], r["name"]): r["status"] for r in result["resources"]}
    expected = {
        (f"compose/kubernetes/{file}", doc["kind"], doc["metadata"]["name"])
        for file, doc in documents()
    }
    assert set(statuses) == expected  # none left out
    assert set(statuses.values()) == {"statusValid"}, result
    kinds = {kind for _, kind, _ in expected}
    assert {"ScaledObject", "HorizontalPodAutoscaler", "StatefulSet", "Deployment"} <= kinds


def test_kubeconform_refuses_a_field_no_schema_names(tmp_path: Path) -> None:
    scaled = of_kind("ScaledObject")["completion-workers"]
    typo = {**scaled, "spec": {**scaled["spec"], "maxReplicaCont": 3}}
    workers = of_kind("StatefulSet")["completion-workers"]
    misplaced = {**workers, "spec": {**workers["spec"], "replica": 2}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([typo, misplaced]))
    result = kubeconform(str(bad))
    assert [r["status"] for r in result["resources"]] == ["statusInvalid"] * 2
    assert "maxReplicaCont" in json.dumps(result)


def test_vendored_keda_schema_is_the_recorded_one() -> None:
    digest = hashlib.sha256(KEDA_SCHEMA.read_bytes()).hexdigest()
    assert digest == KEDA_SCHEMA_SHA256, "regenerate it with scripts/keda_schema.py"


def _containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for kind in ("Deployment", "StatefulSet", "Job"):
        for name, doc in of_kind(kind).items():
            found += [(name, c) for c in doc["spec"]["template"]["spec"]["containers"]]
    return found


def test_every_laneway_setting_is_one_its_service_reads() -> None:
    common = set(of_kind("ConfigMap")["laneway"]["data"])
    problems = []
    for name, container in _containers():
        module = container["command"][-1] if container["command"][0] == "python" else "topics"
        known = {f"LANEWAY_{field.upper()}" for field in SETTINGS[module].model_fields}
        given = common | {e["name"] for e in container.get("env", [])}
        problems += [f"{name}: {v}" for v in sorted(given - known) if v.startswith("LANEWAY_")]
    assert not problems


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_each_pool_scales_on_its_signal_within_its_partitions() -> None:
    [topic_init] = [c for name, c in _containers() if name == "topic-init"]
    partitions = int(_env(topic_init)["LANEWAY_PARTITIONS"])
    workers, scaled, hpas = (
        of_kind("StatefulSet"),
        of_kind("ScaledObject"),
        of_kind("HorizontalPodAutoscaler"),
    )
    signal = DESIRED_REPLICAS._name  # the metric the workers export
    for pool in POOLS:
        name = f"{pool}-workers"
        env = _env(workers[name]["spec"]["template"]["spec"]["containers"][0])
        assert env["LANEWAY_POOL"] == pool
        so, hpa = scaled[name]["spec"], hpas[name]["spec"]
        assert so["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": name,
        }
        assert hpa["scaleTargetRef"] == so["scaleTargetRef"]
        # The signal asks for no more than the autoscalers run, nor they than partitions.
        assert int(env["LANEWAY_SCALE_MAX_REPLICAS"]) == so["maxReplicaCount"] == hpa["maxReplicas"]
        assert so["maxReplicaCount"] <= partitions
        assert int(env["LANEWAY_SCALE_MIN_REPLICAS"]) == so["minReplicaCount"] >= 1
        triggers = {t["type"]: t["metadata"] for t in so["triggers"]}
        assert triggers["prometheus"]["query"] == f'max({signal}{{pool="{pool}"}})'
        assert triggers["kafka"]["consumerGroup"] == Topics().consumer_group(pool)
        external = hpa["metrics"][0]["external"]["metric"]
        assert external == {"name": signal, "selector": {"matchLabels": {"pool": pool}}}
