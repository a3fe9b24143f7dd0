#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project with its test, recipe and logging extras.
#
# torch is installed first, from TORCH_SPEC: on a machine without an NVIDIA GPU the default is the CPU build
# torch==2.13.0 (an unpinned torch would pull a multi-GB CUDA build); with a GPU it is "torch>=2.6".
# TORCH_INDEX_URL, when set, is passed to pip for torch only. Re-running skips work already done.
# transformer-engine is never installed here: on CPU its PyPI meta package breaks `import megatron.core`;
# on GPU machines install the `te` extra yourself.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-"torch>=2.6"}
else
  TORCH_SPEC=${TORCH_SPEC:-"torch==2.13.0"}
fi

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"Python >= 3.11 is required, found {sys.version.split()[0]}; set PYTHON=python3.11")
PY

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

stamp="$VENV/.mbridge-installed"
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

echo "[setup] installing $TORCH_SPEC into $VENV"
"${PIP[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
echo "[setup] installing megatron.bridge with extras recipes,logging,test,dev"
"${PIP[@]}" install -e ".[recipes,logging,test,dev]"
"${PIP[@]}" check
echo "$want" > "$stamp"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch, megatron.core, nvidia_resiliency_ext; print("torch", torch.__version__, "| megatron-core", megatron.core.__version__)' 2>/dev/null)"
