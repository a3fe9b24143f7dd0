"""The step time of the CPU Llama recipe, measured for the benchmarks that report a per-step cost as a share of a step.

A per-step overhead means something only against the step it is added to. :func:`measure_recipe_step` trains
``llama3_tiny_pretrain_config`` (the recipe the main job trains, on its mock stream: no corpus to build) on 2 ranks
with ``python -m megatron.bridge.launch -m megatron.bridge.recipes.run`` and its defaults, and reads rank 0's step
times from the event stream (``step_completed`` events' ``seconds``: the loop's own timing of forward, backward and
optimizer step), not from its log. A script calls it in the same run as its own measurement, so the share is of a
step measured on the same machine under the same load.
"""

import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _process import run_or_exit

from megatron.bridge.training.events.reader import read_file
from megatron.bridge.training.events.stream import EventKind, worker_file

REPO = Path(__file__).resolve().parents[1]
RECIPE = "llama3_tiny_pretrain_config"


@dataclass(frozen=True)
class RecipeStep:
    """The recipe's step time on rank 0 over the steps kept after the warm-up.

    Attributes:
        median_s: median step time.
        mean_s: mean step time.
        steps: how many steps were kept.
    """

    median_s: float
    mean_s: float
    steps: int

    def describe(self) -> str:
        """E.g. ``"30.1 ms step (llama3_tiny_pretrain_config, 2 ranks, median of 25 steps, measured in this run)"``."""
        return f"{self.median_s * 1e3:.1f} ms step ({RECIPE}, 2 ranks, median of {self.steps} steps, this run)"


def measure_recipe_step(steps: int = 30, warmup: int = 5, timeout: float = 300.0) -> RecipeStep:
    """Train the recipe for ``steps`` steps on 2 ranks and return its step time over the steps after ``warmup``.

    Raises:
        SystemExit: the run failed, timed out, or recorded too few steps.
    """
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events"
        cmd = [
            sys.executable, "-m", "megatron.bridge.launch", "--standalone", "--nproc-per-node=2",
            "-m", "megatron.bridge.recipes.run", RECIPE, f"train.train_iters={steps}",
            f"checkpoint.save={Path(tmp) / 'ckpt'}", f"checkpoint.save_interval={steps}",
            f"health.event_dir={events}", f"logger.tensorboard_dir={Path(tmp) / 'tb'}",
        ]  # fmt: skip
        print(f"[recipe step] {' '.join(cmd)}", file=sys.stderr, flush=True)
        out = run_or_exit(cmd, REPO, timeout, f"the {RECIPE} run")
        found, _ = read_file(str(events / worker_file(0)))
    times = [e.seconds for e in found if e.kind == EventKind.STEP_COMPLETED and e.iteration > warmup and e.seconds]
    if len(times) < 5:
        sys.exit(f"the {RECIPE} run recorded {len(times)} steps after a warm-up of {warmup}:\n{out[-3000:]}")
    return RecipeStep(statistics.median(times), statistics.mean(times), len(times))
