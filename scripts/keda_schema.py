"""Extract KEDA's ScaledObject schema for kubeconform into compose/kubernetes/schema/.

Usage: .venv/bin/python scripts/keda_schema.py PATH_TO_keda.sh_scaledobjects.yaml [--ref REF]

The file is ``config/crd/bases/keda.sh_scaledobjects.yaml`` of a checkout of
github.com/kedacore/keda. Each served version's ``openAPIV3Schema`` is written as
``keda.sh/scaledobject_<version>.json``, made strict as kubeconform's own
``openapi2jsonschema.py`` does: an object with ``properties`` and no
``additionalProperties`` of its own refuses fields it does not name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent.parent / "compose" / "kubernetes" / "schema"


def strict(node: Any) -> Any:
    """``node`` with every object that names its properties closed to others."""
    if isinstance(node, dict):
        out = {key: strict(value) for key, value in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(item) for item in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("--ref", default="", help="the KEDA tag or commit, noted in the output")
    args = parser.parse_args()
    crd = yaml.safe_load(args.crd.read_text())
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"].lower()
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = strict(version["schema"]["openAPIV3Schema"])
        # metadata is checked by Kubernetes itself, not by the CRD: leave it open.
        schema["properties"]["metadata"] = {"type": "object"}
        schema["$comment"] = f"kedacore/keda {args.ref} {args.crd.name}, made strict"
        path = OUT / group / f"{kind}_{version['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(schema, indent=1, sort_keys=True) + "\n"
        path.write_text(text)
        print(f"{path} sha256 {hashlib.sha256(text.encode()).hexdigest()}")  # noqa: T201


if __name__ == "__main__":
    main()
