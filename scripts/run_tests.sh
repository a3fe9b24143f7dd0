#!/usr/bin/env bash
# Set up the environment and run the test suite. Two tiers:
#
#   bash scripts/run_tests.sh          # everything (CI): lint, the unit tier, then the functional fault drills
#   bash scripts/run_tests.sh --fast   # lint and the unit tier only (our own logic, on 2 workers; under 3 minutes)
#   bash scripts/run_tests.sh --nvrx 0.7.0   # a release lane: the unit tests and the drills of tests/nvrx_lane.txt
#                                            # against that nvidia-resiliency-ext release (scripts/setup_nvrx_lane.sh),
#                                            # in one session on PYTEST_WORKERS workers
#   bash scripts/run_tests.sh --nvrx 0.7.0 --mcore 0.19.2   # and that megatron-core release (not in CI: 1 GB)
#
# Extra arguments go to pytest. The functional tier (real 2-rank runs on CPU with gloo, real Slurm) runs on
# PYTEST_WORKERS parallel workers (default 3: most drills wait on timeouts, signals and restarts rather than compute);
# a module's tests run on one worker (its module-scoped set-up, such as the Slurm cluster, is made once), the longest
# modules first (tests/conftest.py); drills
# marked serial (straggler scores compare the ranks' CPU time) run alone afterwards. Each run
# gets its own temporary directory, so two runs on one machine do not collide; it is removed when the run passes.
# Every test has a time limit (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
nvrx=""
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
elif [ "${1:-}" = "--nvrx" ]; then
  nvrx=${2:?usage: run_tests.sh --nvrx VERSION [--mcore MCORE_VERSION]}
  shift 2
  if [ "${1:-}" = "--mcore" ]; then
    nvrx="$nvrx --mcore ${2:?usage: run_tests.sh --nvrx VERSION --mcore MCORE_VERSION}"
    shift 2
  fi
fi

install_start=$(date +%s)
bash scripts/setup_env.sh
if [ -n "$nvrx" ]; then
  # shellcheck disable=SC2086  # "VERSION [--mcore MCORE_VERSION]", split on purpose
  lane=$(bash scripts/setup_nvrx_lane.sh $nvrx | tail -1)
  export LANE_BIN="$PWD/$lane/bin"  # scripts/run_main_job.sh puts it first too
  export PATH="$LANE_BIN:$PWD/.venv/bin:$PATH"
  echo "[tests] lane: nvidia-resiliency-ext $nvrx ($lane); install took $(( $(date +%s) - install_start )) s"
else
  [ "$fast" = 1 ] || bash scripts/setup_slurm.sh
  echo "[tests] install took $(( $(date +%s) - install_start )) s"
  export PATH="$PWD/.venv/bin:$PATH"
  echo "[tests] ruff"
  ruff check src tests examples benchmarks
  ruff format --check src tests examples benchmarks
fi

basetemp=$(mktemp -d "${TMPDIR:-/tmp}/mbridge-tests.XXXXXX")
# What the runs leave in the temporary directory (torch elastic's torchelastic_* log folders, one per launch) goes
# with the run's own files, and is removed with them.
# Modes as /tmp has them: munged refuses a socket under a directory not everyone may enter.
chmod 755 "$basetemp"
mkdir -p -m 1777 "$basetemp/tmp"
export TMPDIR="$basetemp/tmp"
statuses=()
run() {  # run one tier; remember its pytest status (5: it collected no test)
  local status=0
  python -m pytest -p no:cacheprovider --basetemp="$basetemp/$1" "${@:2}" || status=$?
  statuses+=("$status")
}

start=$(date +%s)
if [ -n "$nvrx" ]; then
  # One session: the unit tests run on the workers the drills leave idle while they wait on timeouts and restarts
  # (the main job, the longest, starts first: tests/conftest.py).
  echo "[tests] the unit tests and the drills of tests/nvrx_lane.txt on ${PYTEST_WORKERS:-3} workers"
  mapfile -t lane_tests < <(grep -v '^#' tests/nvrx_lane.txt | grep -v '^[[:space:]]*$')
  run lane tests/unit_tests "${lane_tests[@]}" -m "not serial" -q --durations=10 -n "${PYTEST_WORKERS:-3}" \
    --dist loadscope --no-loadscope-reorder "$@"
  echo "[tests] lane tests took $(( $(date +%s) - start )) s"
else
  echo "[tests] unit tier"
  run unit tests -m "not functional" -q --durations=10 -n 2 "$@"
  echo "[tests] unit tier took $(( $(date +%s) - start )) s"
fi
if [ -z "$nvrx" ] && [ "$fast" = 0 ]; then
  func_start=$(date +%s)
  echo "[tests] functional tier on ${PYTEST_WORKERS:-3} workers"
  run functional tests -m "functional and not serial" -v --durations=25 -n "${PYTEST_WORKERS:-3}" --dist loadscope \
    --no-loadscope-reorder "$@"
  echo "[tests] functional drills that must run alone (they judge ranks by their CPU time)"
  run serial tests -m "functional and serial" -v --durations=5 -p no:xdist "$@"
  echo "[tests] functional tier took $(( $(date +%s) - func_start )) s"
fi
echo "[tests] pytest took $(( $(date +%s) - start )) s in all"
# A tier that collected nothing (a -k that selects only the other tier's tests) is fine; every tier empty is not.
failed=0
ran=0
for status in "${statuses[@]}"; do
  [ "$status" = 5 ] && continue
  ran=1
  [ "$status" = 0 ] || failed=1
done
if [ "$ran" = 0 ]; then
  echo "[tests] pytest collected no tests: that is a failure" >&2
  exit 1
fi
if [ "$failed" = 1 ]; then
  echo "[tests] FAILED (temporary files kept in $basetemp)" >&2
  exit 1
fi
rm -rf "$basetemp"
