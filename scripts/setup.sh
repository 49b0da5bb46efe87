#!/usr/bin/env bash
# Idempotent bootstrap for `make up` / `make test` on a fresh Debian machine:
# system packages, .venv with laneway installed, and the Kafka jars (Maven, ~/.m2).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# `--tests`: also what only the test suite needs (`make test`); `make up` goes without.
for_tests=0
case "${1:-}" in
    "") ;;
    --tests) for_tests=1 ;;
    *) die "unknown argument '$1' (usage: scripts/setup.sh [--tests])" ;;
esac

# --- system packages ---------------------------------------------------------------------
apt_packages=()
if ! command -v redis-server >/dev/null 2>&1 && [ ! -x /usr/bin/redis-server ]; then
    apt_packages+=(redis-server)
fi
if [ "$for_tests" -eq 1 ]; then
    # promtool checks the alert rules in compose/ (Debian's prometheus package ships it).
    command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
    # The console's browser tests drive Debian's headless Chromium through its chromedriver.
    command -v chromium >/dev/null 2>&1 || apt_packages+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || apt_packages+=(chromium-driver)
fi
if [ ${#apt_packages[@]} -gt 0 ]; then
    say "installing ${apt_packages[*]} (apt-get)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${apt_packages[@]}"
    # The prometheus package starts a server of its own; laneway only needs promtool.
    if [[ " ${apt_packages[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
        as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi

missing=()
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
if [ "${#missing[@]}" -gt 0 ]; then
    die "the local Kafka broker needs Java 17+ and Maven; install them: apt-get install -y ${missing[*]}"
fi
java_version=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.specification\.version = //p')
if [ "${java_version%%.*}" -lt 17 ] 2>/dev/null; then
    die "Kafka 4 needs Java 17+, found ${java_version}: apt-get install -y openjdk-17-jre-headless"
fi

# --- Python virtualenv -------------------------------------------------------------------
# Usable means pip runs in it: a venv whose ensurepip failed has a python but no pip, and
# every later run would skip creating it and fail at the install below.
venv_usable() { .venv/bin/python -m pip --version >/dev/null 2>&1; }
if ! venv_usable; then
    python=""
    for candidate in python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
            python=$candidate
            break
        fi
    done
    [ -n "$python" ] || die "need Python 3.11+: apt-get install -y python3.11 python3.11-venv"
    say "creating .venv with $("$python" --version 2>&1)"
    rm -rf .venv
    if ! "$python" -m venv .venv || ! venv_usable; then
        rm -rf .venv  # half made: the next run starts afresh
        die "could not create .venv with pip in it; on Debian: apt-get install -y ${python}-venv"
    fi
fi

stamp=.venv/.laneway-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    # constraints.txt holds every package at the version the suite last passed on.
    say "installing laneway and its dev tools into .venv (pinned: constraints.txt; pip cache: ~/.cache/pip)"
    .venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt -e '.[dev]'
    touch "$stamp"
fi

# --- kubeconform: checks compose/kubernetes/ in the tests, offline -------------------------
if [ "$for_tests" -eq 1 ] && ! scripts/kubeconform.sh --install; then
    [ -z "${CI:-}" ] || die "kubeconform could not be installed (see above)"
    say "warning: kubeconform is missing; tests/test_kubernetes.py will be skipped"
fi

# --- Kafka jars ---------------------------------------------------------------------------
say "checking the Kafka broker jars"
.venv/bin/python -c '
import logging
logging.basicConfig(level=logging.INFO, format="setup: %(message)s")
from ops.devstack import ServiceError
from ops.kafka_jars import kafka_classpath
try:
    kafka_classpath()
except ServiceError as exc:
    raise SystemExit(f"setup: error: {exc}") from None
'
say "ready"
