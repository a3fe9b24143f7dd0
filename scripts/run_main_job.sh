#!/usr/bin/env bash
# The main job: set up the environment, train the tiny GPT on 2 ranks with checkpoints, stop it part-way,
# resume it, and verify every checkpoint it committed. Runs on a CPU-only machine (gloo) or GPUs (NCCL).
#
#   RUN_DIR   where checkpoints, TensorBoard logs and the log go (default runs/main_job; emptied first)
#   NPROC     ranks (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
export PYTHONWARNINGS="ignore::FutureWarning,ignore::UserWarning"

RUN_DIR=${RUN_DIR:-runs/main_job}
NPROC=${NPROC:-2}
CKPT="$RUN_DIR/checkpoints"
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"

train() {
  set +e
  python -m megatron.bridge.launch --standalone --nproc-per-node="$NPROC" examples/pretrain_tiny_gpt.py \
    checkpoint.save="$CKPT" checkpoint.load="$CKPT" checkpoint.save_interval=5 checkpoint.async_save=true \
    train.train_iters=20 logger.tensorboard_dir="$RUN_DIR/tensorboard" "$@" 2>&1 | tee -a "$RUN_DIR/train.log" \
    | grep --line-buffered -E "\[rank0\].*(megatron\.bridge|Error)|Error"
  local codes=("${PIPESTATUS[@]}")
  set -e
  return "${codes[0]}"
}

echo "== 1/3: train, stopping at iteration 10 (train.exit_interval=10, exit code 20)"
first=0; train train.exit_interval=10 || first=$?
[ "$first" -eq 20 ] || { echo "expected exit code 20 (EXIT_INTERVAL), got $first" >&2; exit 1; }

echo "== 2/3: resume from the newest verified checkpoint and train to iteration 20"
train
echo "== 3/3: verify every committed checkpoint against its manifest"
mbridge-verify-checkpoint "$CKPT" --all
echo "main job done: logs in $RUN_DIR/train.log, TensorBoard in $RUN_DIR/tensorboard"
