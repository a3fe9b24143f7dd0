#!/usr/bin/env bash
# The main job: the resiliency drill. Sets up the environment, makes a small corpus offline, then trains the CPU
# Llama recipe (two pipeline stages) on 2 ranks under ft_launcher with every resiliency feature on, twice: once fault-free (the reference) and once with a schedule of
# real faults (a NaN loss, a killed rank, a preemption signal, a corrupted local checkpoint, a hung rank, a slowed
# rank). Prints a table of each fault's detection latency, recovery time and steps lost, the job's goodput across
# restarts, and whether the final weights equal the reference's bit for bit; writes a timeline plot, TensorBoard logs
# and a JSON report. Runs on a CPU-only machine (gloo) or GPUs (NCCL). Exit code 0 when the drill passed.
#
#   RUN_DIR   where everything goes (default runs/main_job; emptied first)
#   LANE_BIN  a release lane's bin directory, put before .venv's (set by scripts/run_tests.sh --nvrx)
#   Arguments go to the drill, e.g. --faults "kill@30:1,hang@50:0" --train-iters 80 (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PATH="${LANE_BIN:+$LANE_BIN:}$PWD/.venv/bin:$PATH"
export PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning"
RUN_DIR=${RUN_DIR:-runs/main_job}
exec python -m megatron.bridge.drill --run-dir "$RUN_DIR" "$@"
