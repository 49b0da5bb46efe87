"""Extract the OpenAI schemas laneway must match into tests/data/openai_schemas.json.

Usage: .venv/bin/python scripts/openai_schemas.py PATH_TO_OPENAI_OPENAPI_CHECKOUT [--out FILE]

PATH is a checkout of github.com/openai/openai-openapi (or its openapi.json / openapi.yaml).
The output keeps each schema under its own ``#/components/schemas/`` name, so the ``$ref``s
stay as OpenAI wrote them, and records where it came from. Two rewrites, both named in it:
OpenAPI 3.0's ``nullable: true`` becomes ``anyOf [schema, null]`` (its meaning; JSON Schema
has no such keyword), and prose (descriptions, examples, ``x-`` extensions) is left out.
Of the request bodies only the field names are kept (``request_fields``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = "openai/openai-openapi"
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "openai_schemas.json"

# The bodies laneway sends: /v1/models, /v1/completions (whose stream chunks are this same
# object), /v1/chat/completions and its stream chunks, and every error body.
ROOTS = (
    "ListModelsResponse",
    "Model",
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CompletionUsage",
    "ErrorResponse",
    "Error",
)
# Request bodies: only their field names are kept, so a test can see that laneway decided on
# each one (honoured, accepted as inert, or refused).
REQUESTS = (
    "CreateCompletionRequest",
    "CreateChatCompletionRequest",
    "ChatCompletionRequestMessage",
    "ChatCompletionStreamOptions",
)
_PROSE = {"description", "example", "examples", "title"}
_REF_PREFIX = "#/components/schemas/"


def _spec_file(path: Path) -> Path:
    if path.is_file():
        return path
    for name in ("openapi.json", "openapi.yaml"):
        if (path / name).is_file():
            return path / name
    raise SystemExit(f"no openapi.json or openapi.yaml in {path}")


def _load(spec: Path) -> dict[str, Any]:
    if spec.suffix == ".json":
        loaded = json.loads(spec.read_text())
    else:
        import yaml  # noqa: PLC0415 - only the YAML form of the spec needs it

        loaded = yaml.safe_load(spec.read_text())
    if not isinstance(loaded, dict):
        raise SystemExit(f"{spec} is not an OpenAPI document")
    return loaded


def _git(checkout: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def _clean(node: Any, *, names: bool = False) -> Any:
    """Drop prose and rewrite ``nullable``; ``names`` marks a ``properties`` map, whose keys
    are field names (a field may well be called ``description``), not keywords."""
    if isinstance(node, list):
        return [_clean(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: _clean(value) for key, value in node.items()}
    out = {
        key: _clean(value, names=key in ("properties", "patternProperties"))
        for key, value in node.items()
        if key not in _PROSE and not key.startswith("x-") and key != "nullable"
    }
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node))
    if not isinstance(node, dict):
        return set()
    found = set().union(*(_refs(value) for value in node.values()))
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith(_REF_PREFIX):
            raise SystemExit(f"unexpected $ref {ref!r}: only {_REF_PREFIX}... is followed")
        found.add(ref.removeprefix(_REF_PREFIX))
    return found


def extract(document: dict[str, Any]) -> dict[str, Any]:
    """The ROOTS and every schema they ``$ref``, cleaned, by name."""
    schemas = document["components"]["schemas"]
    picked: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in picked:
            continue
        picked[name] = _clean(schemas[name])
        todo.extend(_refs(picked[name]))
    return dict(sorted(picked.items()))


def field_names(schemas: dict[str, Any], node: Any, seen: frozenset[str] = frozenset()) -> set[str]:
    """Every property name ``node`` may carry, through ``$ref``, allOf, oneOf and anyOf."""
    if not isinstance(node, dict):
        return set()
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix(_REF_PREFIX)
        return set() if name in seen else field_names(schemas, schemas[name], seen | {name})
    names = set(node.get("properties", {}))
    for key in ("allOf", "oneOf", "anyOf"):
        for sub in node.get(key, []):
            names |= field_names(schemas, sub, seen)
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help=f"a checkout of {REPO}, or its spec file")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--commit", default="", help="the commit, if PATH is not a git checkout")
    args = parser.parse_args(argv)
    spec = _spec_file(args.checkout)
    document = _load(spec)
    where = spec.parent
    source = {
        "repo": REPO,
        "path": spec.name,
        "commit": args.commit or _git(where, "rev-parse", "HEAD"),
        "commit_date": _git(where, "log", "-1", "--format=%cI"),
        "version": document["info"]["version"],
        "openapi": document["openapi"],
        "extracted_by": "scripts/openai_schemas.py",
        "rewrites": [
            "nullable: true -> anyOf [schema, {type: null}] (OpenAPI 3.0's meaning)",
            "description, example(s), title and x-* extensions left out",
        ],
    }
    if not source["commit"]:
        raise SystemExit(f"{where} is not a git checkout: name the commit with --commit")
    schemas = document["components"]["schemas"]
    requests = {name: sorted(field_names(schemas, schemas[name])) for name in REQUESTS}
    out = {
        "source": source,
        "request_fields": requests,
        "components": {"schemas": extract(document)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    sys.stderr.write(f"{len(out['components']['schemas'])} schemas -> {args.out}\n")


if __name__ == "__main__":
    main()
