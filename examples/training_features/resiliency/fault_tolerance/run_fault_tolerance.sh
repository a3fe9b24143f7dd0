#!/usr/bin/env bash
# Fault tolerance demo: train the tiny GPT under ft_launcher with section timeouts and in-job restarts.
#
#   run_fault_tolerance.sh                  train to the end; look for the [FaultTolerance] timeout lines
#   run_fault_tolerance.sh --simulate-fault rank 1 hangs 4 s into training; the rank monitor detects the hung
#                                           section (`step`, or `checkpointing` if the hang strikes during a save),
#                                           ft_launcher restarts the workers, training resumes from the newest
#                                           verified checkpoint (from iteration 0 if the hang struck before the
#                                           first one, as it can on a busy machine) and completes
#
# Environment: NPROC (default 2), RUN_DIR (default runs/fault_tolerance), MAX_RESTARTS (default 3),
# STEP_TIMEOUT (seconds, default 10), TRAIN_ITERS (default 200; 600 with --simulate-fault, so training is still
# running when the fault strikes even where a step takes only a few milliseconds). On a GPU node the same command
# uses NCCL.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
[ -x .venv/bin/ft_launcher ] && export PATH="$PWD/.venv/bin:$PATH"
export PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning"

NPROC=${NPROC:-2}
RUN_DIR=${RUN_DIR:-runs/fault_tolerance}
MAX_RESTARTS=${MAX_RESTARTS:-3}
STEP_TIMEOUT=${STEP_TIMEOUT:-10}
CKPT="$RUN_DIR/checkpoints"
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"

extra=()
if [ "${1:-}" = "--simulate-fault" ]; then
  # On a 2-core CPU machine the first checkpoint (iteration 20) is written within ~1 s of the start of training and
  # a step takes 15-40 ms; the hang strikes at 4 s, well inside the 600 iterations.
  TRAIN_ITERS=${TRAIN_ITERS:-600}
  extra=(ft.simulate_fault=true ft.simulated_fault_type=rank_hung ft.simulated_fault_rank=1
         ft.simulated_fault_base_delay=4)
elif [ -n "${1:-}" ]; then
  echo "usage: $0 [--simulate-fault]" >&2
  exit 2
fi

python -m megatron.bridge.ft_launch --nproc-per-node="$NPROC" --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 \
  --max-restarts="$MAX_RESTARTS" \
  --ft-rank-section-timeouts="setup:180,step:${STEP_TIMEOUT},checkpointing:120" \
  --ft-rank-out-of-section-timeout=60 --ft-workload-check-interval=1 \
  examples/pretrain_tiny_gpt.py \
  train.train_iters="${TRAIN_ITERS:-200}" checkpoint.save="$CKPT" checkpoint.load="$CKPT" checkpoint.save_interval=20 \
  logger.log_interval=20 ft.enable_ft_package=true ft.calc_ft_timeouts=true "${extra[@]}" 2>&1 \
  | tee "$RUN_DIR/train.log" \
  | grep --line-buffered -E "\[rank0\].*megatron\.bridge|RankMonServer.*(Section|timeout)|FaultTolerance|restart worker group|Agent exits|fault injection|simulat"
exit "${PIPESTATUS[0]}"
