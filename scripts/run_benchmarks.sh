#!/usr/bin/env bash
# Run every benchmark in benchmarks/ and print one markdown table of their results (ratios against baselines measured
# in the same run, times held to fixed goals in seconds, and what could not be tried here, with why) plus the
# machine they ran on.
# Sets up the environment first; ft_launcher (used by the fault-tolerance benchmarks) comes from .venv/bin.
# Takes 10-25 minutes on a 2-core CPU machine; progress goes to stderr, the table to stdout.
#
#   bash scripts/run_benchmarks.sh [--only NAME[,NAME]] [--output FILE] [--timeout SECONDS] [--list]
#
# Exits non-zero when a benchmark failed or printed no result (it still gets a row in the table).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >&2
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning"
command -v ft_launcher >/dev/null || { echo "ft_launcher not found on PATH after setup" >&2; exit 1; }
exec python benchmarks/report.py "$@"
