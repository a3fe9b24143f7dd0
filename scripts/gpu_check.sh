#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it checks): install what the machine lacks, then run it.
#
#   bash scripts/gpu_check.sh OUTDIR            # on a GPU machine: needs .wheels/gpu/ (scripts/fetch_gpu_wheels.sh)
#   bash scripts/gpu_check.sh OUTDIR --dry-run  # on CPU, in the current environment (.venv), tiny model, ~1 minute
#
# Arguments after OUTDIR go to scripts/gpu_check.py (--budget SECONDS, --scratch DIR).
# Real mode, with no network: the wheels of scripts/gpu_wheels.txt are installed from .wheels/gpu/ with
# `pip install --no-index --no-deps` into a virtual environment ($GPU_CHECK_VENV, default /tmp/mbridge-gpu-venv) that
# also sees the packages of the Python that holds torch ($PYTHON, default python3; through a .pth file, after the
# venv's own), so the preinstalled torch is used and never replaced; then this project, editable, without build
# isolation. Where no virtual environment can be made, the wheels go to a folder put first on PYTHONPATH instead
# (the project then runs from src/). Everything printed,
# the install and the check's progress, also goes to OUTDIR/gpu_check.log. Exit code: the check's (0: every part
# passed; 3: the install failed).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/gpu_check.sh OUTDIR [--dry-run]" >&2
  exit 2
fi
OUTDIR=$1
shift
DRY=0
for arg in "$@"; do
  [ "$arg" = --dry-run ] && DRY=1
done
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1

if [ "$DRY" = 1 ]; then
  # The current environment: $PYTHON, else python3 if it has torch, else the project's .venv.
  PY=${PYTHON:-python3}
  if [ -z "${PYTHON:-}" ] && ! "$PY" -c 'import torch' 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
  fi
  exec "$PY" scripts/gpu_check.py "$OUTDIR" "$@"
fi

exec > >(tee "$OUTDIR/gpu_check.log") 2>&1  # everything below, the check's progress too, also goes to the log
BASE=${PYTHON:-python3}
WHEELS=.wheels/gpu
VENV=${GPU_CHECK_VENV:-/tmp/mbridge-gpu-venv}
start=$(date +%s)
echo "[install] $(date -Is) base python: $(command -v "$BASE")"
nvidia-smi -L || echo "[install] nvidia-smi -L failed"

mapfile -t WANT < <(grep -vE '^\s*(#|$)' scripts/gpu_wheels.txt)
FILES=()
for req in "${WANT[@]}"; do
  name=${req%%==*}
  version=${req#*==}
  file=$(find "$WHEELS" -maxdepth 1 -iname "$(echo "$name" | tr '-' '_')-${version}-*.whl" 2>/dev/null | head -1)
  if [ -z "$file" ]; then
    echo "[install] no wheel for $req in $WHEELS: run bash scripts/fetch_gpu_wheels.sh where there is network"
    exit 3
  fi
  FILES+=("$file")
done

install_to_venv() {
  # A virtual environment (without pip of its own: the base Python's pip installs into it) that sees the base
  # Python's packages, torch among them, after its own: a .pth line runs site.addsitedir for each of the base's
  # site directories (their own .pth files included).
  local sites venv_site
  sites=$("$BASE" -c 'import site, sysconfig; p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()])))') || return 1
  rm -rf "$VENV"
  "$BASE" -m venv --without-pip "$VENV" || return 1
  venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  while read -r dir; do
    echo "import site; site.addsitedir('$dir')"
  done <<< "$sites" > "$venv_site/zz_base_python.pth"
  local pip=("$BASE" -m pip --python "$VENV/bin/python" --disable-pip-version-check)
  "${pip[@]}" install -q --no-index --no-deps --no-compile "${FILES[@]}" || return 1
  "${pip[@]}" install -q --no-index --no-deps --no-build-isolation -e . || return 1
  "$VENV/bin/python" -c 'import torch, megatron.core, nvidia_resiliency_ext, megatron.bridge' || return 1
  PY="$VENV/bin/python"
}

install_to_folder() {
  # No virtual environment: the wheels in a folder put first on PYTHONPATH, the project from src/.
  local site=${GPU_CHECK_SITE:-/tmp/mbridge-gpu-site}
  rm -rf "$site"
  "$BASE" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --target "$site" \
    "${FILES[@]}" || return 1
  export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  PY=$BASE
}

if install_to_venv; then
  echo "[install] ${#FILES[@]} wheels and the project (editable) installed into $VENV"
elif install_to_folder; then
  echo "[install] no virtual environment: ${#FILES[@]} wheels installed into a folder ($PYTHONPATH)"
else
  echo "[install] FAILED: the wheels did not install"
  exit 3
fi
echo "[install] took $(( $(date +%s) - start )) s"
"$PY" - <<'PY'
import importlib.metadata as md, platform
import torch
print(f"[versions] python {platform.python_version()} | torch {torch.__version__} ({torch.__file__}) | CUDA "
      f"{torch.version.cuda} | megatron-core {md.version('megatron-core')} | nvidia-resiliency-ext "
      f"{md.version('nvidia-resiliency-ext')}")
print(f"[versions] device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
PY
"$PY" scripts/gpu_check.py "$OUTDIR" "$@"
exit $?
