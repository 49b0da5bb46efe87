"""The Kafka broker's jars, resolved from scripts/kafka/pom.xml with Maven into a cache that
outlives runs (the first run downloads them)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from laneway.errors import ServiceError
from ops.devstack import LOG_TAIL_LINES, run_tool

__all__ = ["cache_dir", "kafka_classpath"]

log = logging.getLogger(__name__)

_POM = Path(__file__).resolve().parent.parent / "scripts" / "kafka" / "pom.xml"
# The first resolve downloads ~100 MB; a registry that stops answering must not hang setup.
_MVN_TIMEOUT_S = 1200.0


def cache_dir() -> Path:
    """Downloads and resolved classpaths live here: ``$LANEWAY_CACHE_DIR`` or ~/.cache/laneway."""
    configured = os.environ.get("LANEWAY_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "laneway"


def _require(program: str, install_hint: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise ServiceError(f"`{program}` is not on PATH; install it ({install_hint})")
    return found


def kafka_classpath(cache: Path | None = None) -> str:
    """Resolve the Kafka broker jars with Maven (cached) and return the Java classpath."""
    _require("java", "apt-get install openjdk-17-jre-headless")
    mvn = _require("mvn", "apt-get install maven")
    if not _POM.is_file():
        raise ServiceError(f"{_POM} is missing; the Kafka jars are resolved from it")
    pom_digest = hashlib.sha256(_POM.read_bytes()).hexdigest()[:12]
    target_dir = (cache or cache_dir()) / "kafka"
    target = target_dir / f"classpath-{pom_digest}.txt"
    if target.is_file():
        classpath = target.read_text().strip()
        missing = [jar for jar in classpath.split(os.pathsep) if not Path(jar).is_file()]
        if classpath and not missing:
            return classpath
        log.info(
            "cached Kafka classpath lacks %d jar(s) (e.g. %s); re-resolving",
            len(missing),
            missing[:1],
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    log.info("resolving Kafka jars with Maven (first run downloads ~100 MB into ~/.m2)")
    started = time.monotonic()
    argv = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(_POM),
        "dependency:build-classpath",
        f"-Dmdep.outputFile={partial}",
    ]
    result = run_tool(
        argv,
        _MVN_TIMEOUT_S,
        f"mvn resolving the Kafka jars from {_POM} (a registry that does not answer?)",
    )
    if result.returncode != 0 or not partial.is_file():
        output = (result.stdout + result.stderr).strip().splitlines()
        raise ServiceError(
            f"mvn could not resolve the Kafka jars from {_POM} (exit {result.returncode}):\n"
            + "\n".join(output[-LOG_TAIL_LINES:])
        )
    partial.replace(target)
    log.info("Kafka classpath resolved in %.1fs", time.monotonic() - started)
    return target.read_text().strip()
