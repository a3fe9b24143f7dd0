#!/usr/bin/env bash
# Download the wheels scripts/gpu_wheels.txt lists into .wheels/gpu/ (for Python 3.12, manylinux x86_64), print
# their total size, and check that they install together without the network on a machine where torch 2.11 is
# already installed.
#
#   bash scripts/fetch_gpu_wheels.sh
#
# Needs pip and PyPI (any Python >= 3.9 runs it: pip downloads for the target's Python and platform, not its own).
# The check is pip's own resolver, offline (--no-index), over the downloaded wheels plus empty stand-ins for what
# the GPU machine has or what is left out on purpose (see gpu_wheels.txt): torch 2.11.0, and uvicorn's "standard"
# extras. It fails, naming the requirement, when a wheel needs something that is neither carried nor stood in for.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LIST=scripts/gpu_wheels.txt
DEST=.wheels/gpu
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_39_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64 --platform any)
PIP=("$PYTHON" -m pip --disable-pip-version-check)

mkdir -p "$DEST"
# Wheels of versions no longer listed would be installed too (the install takes every listed name's one wheel,
# but a stale one confuses a person reading the folder): start from the list each time.
find "$DEST" -maxdepth 1 -name '*.whl' -delete
"${PIP[@]}" download -q --no-deps "${TARGET[@]}" -d "$DEST" -r "$LIST"

listed=$(grep -cvE '^\s*(#|$)' "$LIST")
found=$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$listed" != "$found" ]; then
  echo "fetch_gpu_wheels: $LIST lists $listed wheels but $DEST holds $found" >&2
  exit 1
fi

stubs=$(mktemp -d)
trap 'rm -rf "$stubs"' EXIT
"$PYTHON" - "$stubs" <<'PY'
import sys, zipfile
# Empty wheels standing for what the GPU machine provides (torch) or what is left out on purpose.
for name, version in [("torch", "2.11.0"), ("uvloop", "999"), ("httptools", "999"),
                      ("watchfiles", "999"), ("websockets", "999")]:
    dist = f"{name}-{version}"
    with zipfile.ZipFile(f"{sys.argv[1]}/{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
PY
echo "[fetch] checking that the listed wheels resolve offline with torch 2.11.0 already there ..."
"${PIP[@]}" install --dry-run --ignore-installed --no-index --find-links "$DEST" --find-links "$stubs" "${TARGET[@]}" \
  --ignore-requires-python --target "$stubs/target" -r "$LIST" "torch==2.11.0" -q --report "$stubs/report.json"
"$PYTHON" - "$stubs/report.json" "$LIST" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
listed = {}
for line in open(sys.argv[2]):
    line = line.split("#")[0].strip()
    if line:
        name, version = re.split(r"==", line)
        listed[name.lower()] = version
stood_in = sorted(set(chosen) - set(listed))
missing = sorted(set(listed) - set(chosen))
if missing:
    sys.exit(f"fetch_gpu_wheels: not part of the resolved install: {missing}")
print(f"[fetch] resolves: {len(listed)} carried wheels; stood in for: {', '.join(stood_in)}")
PY
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "[fetch] $found wheels in $DEST, $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') in total"
