#!/usr/bin/env bash
# Make .venv-nvrx-VERSION: the test environment (.venv, set up first) with nvidia-resiliency-ext VERSION instead of
# the release pyproject.toml installs, from that release's published wheel.
#
#   bash scripts/setup_nvrx_lane.sh 0.7.0                 # prints the environment's directory last
#   bash scripts/setup_nvrx_lane.sh 0.7.0 --mcore 0.19.2  # .venv-nvrx-0.7.0-mcore-0.19.2: that megatron-core too
#
# The lane is a virtual environment of its own that holds only that release (and what it needs that .venv lacks),
# with .venv's packages behind it (a .pth file), so the two releases never mix and .venv stays as it is.
# Where no published wheel's tags admit this Python and platform (0.6.0 and 0.7.0 need glibc >= 2.39; 0.7.0 has
# wheels for Python 3.12 and 3.14 only), the nearest published wheel is re-tagged for this Python, and the script
# says so: its Python code is what users run; its one compiled file (the CUPTI kernel profiler, for CUDA 13) is
# never loaded on CPU. A re-tagged wheel is a test device only: users install the published wheels as they are.
# Wheels are kept in .wheels/nvrx (ignored by git); re-running reuses them and a finished lane.
#
# --mcore: megatron-core 0.17 and later publish wheels for Python >= 3.12 only; the Python 3.12 wheel is re-tagged
# and installed ignoring its Python requirement (its code runs on 3.11), its C++ dataset helpers are compiled for
# this Python (pybind11, g++), and triton, which it imports, is installed (about 1 GB: not in CI). Checked so:
# 0.17.1, 0.18.2 and 0.19.2 with nvidia-resiliency-ext 0.7.0 (megatron-core >= 0.17 needs nvidia-resiliency-ext >= 0.6).
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:?usage: setup_nvrx_lane.sh VERSION [--mcore MCORE_VERSION] (an nvidia-resiliency-ext release, e.g. 0.7.0)}
mcore=""
if [ "${2:-}" = "--mcore" ]; then
  mcore=${3:?usage: setup_nvrx_lane.sh VERSION --mcore MCORE_VERSION}
fi
main=${VENV:-.venv}
lane=".venv-nvrx-$version${mcore:+-mcore-$mcore}"
wheels=".wheels/nvrx"
say() { echo "[nvrx $version${mcore:+, megatron-core $mcore}] $*" >&2; }

[ -x "$main/bin/python" ] || { say "$main is missing: run scripts/setup_env.sh first"; exit 1; }
stamp="$lane/.mbridge-lane"
want="$(cat scripts/setup_nvrx_lane.sh | sha256sum | cut -c1-16) $version $mcore"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  say "$lane is up to date"
  echo "$lane"
  exit 0
fi

mkdir -p "$wheels"
py_tag=$("$main/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
PIP=("$main/bin/python" -m pip --disable-pip-version-check -q)
download() {  # download DIR [pip download options]: the release's wheel into DIR; prints its file name
  local dir=$1
  shift
  mkdir -p "$dir"
  "${PIP[@]}" download --no-deps --only-binary=:all: -d "$dir" "nvidia-resiliency-ext==$version" "$@" >/dev/null 2>&1 \
    && ls "$dir" | grep -E "^nvidia_resiliency_ext-$version-" | head -1
}
retagged="nvidia_resiliency_ext-$version-$py_tag-$py_tag-linux_x86_64.whl"
if [ -f "$wheels/$retagged" ]; then
  usable=$retagged
  say "re-using $retagged (re-tagged for testing only, as below)"
elif usable=$(download "$wheels/published-$py_tag"); then
  say "installing the published wheel $usable"
  usable="published-$py_tag/$usable"
else
  published=""
  for py in "${py_tag#cp3}" 12 14; do
    published=$(download "$wheels/published-cp3$py" --python-version "3.$py" --platform manylinux_2_39_x86_64) && break
  done
  [ -n "$published" ] || { say "no published wheel of nvidia-resiliency-ext $version found"; exit 1; }
  say "no published wheel's tags admit this machine ($py_tag, glibc $(ldd --version | head -1 | awk '{print $NF}'));"
  say "re-tagging $published as $retagged for testing only (its compiled CUPTI module is never loaded on CPU;"
  say "users install the published wheels as they are)"
  "$main/bin/python" -m wheel tags --python-tag "$py_tag" --abi-tag "$py_tag" --platform-tag linux_x86_64 \
    "$wheels/published-cp3$py/$published" >/dev/null
  mv "$wheels/published-cp3$py/$retagged" "$wheels/$retagged"
  usable=$retagged
fi

rm -rf "$lane"
"$main/bin/python" -m venv "$lane"
site=$("$lane/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# .venv's packages behind the lane's own, with their .pth files (the project's editable install among them).
echo "import site; site.addsitedir('$main_site')" > "$site/_mbridge_main_venv.pth"
say "installing $usable into $lane (with what it needs that $main lacks)"
"$lane/bin/python" -m pip --disable-pip-version-check -q install "$wheels/$usable" 2>&1 | grep -v "^WARNING: Location" \
  >&2 || true
if [ -n "$mcore" ]; then
  mcore_retagged="megatron_core-$mcore-$py_tag-$py_tag-linux_x86_64.whl"
  if [ ! -f "$wheels/$mcore_retagged" ]; then
    "${PIP[@]}" download --no-deps --only-binary=:all: -d "$wheels/published-cp312" --python-version 3.12 \
      --platform manylinux_2_28_x86_64 "megatron-core==$mcore" >/dev/null 2>&1 \
      || { say "no published Python 3.12 wheel of megatron-core $mcore found"; exit 1; }
    published=$(ls "$wheels/published-cp312" | grep -E "^megatron_core-$mcore-cp312" | head -1)
    say "re-tagging $published as $mcore_retagged for testing only (megatron-core >= 0.17 needs Python 3.12)"
    "$main/bin/python" -m wheel tags --python-tag "$py_tag" --abi-tag "$py_tag" --platform-tag linux_x86_64 \
      "$wheels/published-cp312/$published" >/dev/null
    mv "$wheels/published-cp312/$mcore_retagged" "$wheels/$mcore_retagged"
  fi
  say "installing $mcore_retagged, triton and pybind11 into $lane"
  "$lane/bin/python" -m pip --disable-pip-version-check -q install --no-deps --ignore-requires-python \
    "$wheels/$mcore_retagged" triton pybind11 2>&1 | grep -v "^WARNING: Location" >&2 || true
  helpers=$("$lane/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/megatron/core/datasets
  suffix=$("$lane/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  say "compiling megatron-core's dataset helpers for this Python"
  g++ -O3 -shared -std=c++11 -fPIC $("$lane/bin/python" -m pybind11 --includes) "$helpers/helpers.cpp" \
    -o "$helpers/helpers_cpp$suffix"
  got=$("$lane/bin/python" -c 'from importlib.metadata import version; print(version("megatron-core"))')
  [ "$got" = "$mcore" ] || { say "the lane has megatron-core $got, not $mcore"; exit 1; }
fi
got=$("$lane/bin/python" -c 'from importlib.metadata import version; print(version("nvidia-resiliency-ext"))')
[ "$got" = "$version" ] || { say "the lane has nvidia-resiliency-ext $got, not $version"; exit 1; }
"$lane/bin/python" -W ignore -c "import megatron.bridge, megatron.core, nvidia_resiliency_ext.fault_tolerance" || {
  say "the lane does not import"; exit 1; }
echo "$want" > "$stamp"
say "ready: $lane"
echo "$lane"
