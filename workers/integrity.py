"""Model integrity: a digest of a model's config and weight manifest, for heartbeats.

Two workers of one pool reporting different digests serve different models: a bad rollout
or a corrupted download shows up in /readyz and on the dashboards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["model_digest"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_digest(model: str, *, extra: str = "") -> str:
    """sha256 of config.json and (name, size) of every weight file; of the id if not local."""
    digest = hashlib.sha256(extra.encode())
    root = Path(model)
    if not root.is_dir():
        digest.update(f"id:{model}".encode())
        return digest.hexdigest()[:16]
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(p for p in root.rglob("*") if p.suffix in _WEIGHT_SUFFIXES):
        digest.update(f"{path.relative_to(root)}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]
