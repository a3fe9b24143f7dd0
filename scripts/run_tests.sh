#!/usr/bin/env bash
# Set up the environment and run the whole test suite: lint, unit tests, then the functional fault drills
# (real 2-rank runs on CPU with gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_slurm.sh
export PATH="$PWD/.venv/bin:$PATH"

echo "[tests] ruff"
ruff check src tests examples benchmarks
ruff format --check src tests examples benchmarks

echo "[tests] pytest"
set +e
python -m pytest tests -v --durations=15 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "[tests] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$status"
