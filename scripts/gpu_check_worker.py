"""Training entry of the GPU check: a recipe run as ``python -m megatron.bridge.recipes.run`` runs it, plus two probes.

Every rank runs ``pretrain.main`` with the recipe named first on the command line, the dotted overrides after it, and
the GPT forward step, as ``megatron.bridge.recipes.run`` does. What the probes add, each only when its variable is set:

- ``GPU_CHECK_MEMORY=<file>``: after every step, the rank appends one JSON line: the attempt within this process
  (0, then 1 after an in-process restart), the process id, the iteration, the model's parameter count, and
  ``torch.cuda.memory_allocated()``/``memory_reserved()`` (``null`` without CUDA).
- ``GPU_CHECK_SLOW=<iteration>:<factor>``: from that iteration on, the rank's steps take about ``factor`` times as
  long: every forward pass (micro-batch) also runs matrix products on the training device, in all worth ``factor -
  1`` times the median step time measured before, so that CUDA kernel timing sees the slowdown (a sleep would only
  show in wall time) and so does the wall time of every forward pass (the CPU's score source, a median over the
  passes). On a GPU the number of products is sized once; on CPU each pass runs them until its share of that time
  is spent, since a shared CPU's load moves the time one product takes. The products read constant tensors made
  here and write a buffer nobody reads: the training state and every random generator are untouched.

    python -m megatron.bridge.ft_launch --nproc-per-node=1 ... scripts/gpu_check_worker.py
        llama3_tiny_pretrain_config key=value ...
"""

import json
import os
import statistics
import sys
import time
from typing import Any, Optional

MEMORY_ENV = "GPU_CHECK_MEMORY"
SLOW_ENV = "GPU_CHECK_SLOW"
_BEFORE_SLOW = 8
"""Step times (the latest before the slowdown) whose median the extra work is sized from."""


class Probe:
    """The two probes as a Megatron-Bridge callback (see the module doc); inert when neither variable is set."""

    def __init__(self) -> None:
        self.attempt = -1
        self.iteration = 0
        self.params: Optional[int] = None
        self.memory_path = os.environ.get(MEMORY_ENV) or None
        self.slow_from: Optional[int] = None
        self.factor = 1.0
        if os.environ.get(SLOW_ENV):
            start, factor = os.environ[SLOW_ENV].split(":")
            self.slow_from, self.factor = int(start), float(factor)
        self.step_times: list[float] = []
        self.products = 0
        """Matrix products each forward pass of a slowed step runs (sized once, at the first slowed step)."""
        self.slowed = False
        self.calls = 0
        """Forward passes in the current step."""
        self.calls_per_step = 1
        self.extra_seconds: Optional[float] = None
        """On CPU, the wall time each forward pass of a slowed step adds (the products run until it is spent)."""
        self._operands: Any = None

    def on_train_start(self, context: Any) -> None:
        """A new attempt in this process: the first, or one after an in-process restart."""
        self.attempt += 1

    def on_train_step_start(self, context: Any) -> None:
        """Note the iteration about to run; from the slowdown's start, slow its forward passes."""
        self.iteration = context.state.train_state.step + 1
        self.calls_per_step = max(self.calls_per_step, self.calls)
        self.calls = 0
        self.slowed = self.slow_from is not None and self.iteration >= self.slow_from
        if self.slowed and self._operands is None:
            self._size_extra_work()

    def on_train_step_end(self, context: Any) -> None:
        """Keep the step time (before the slowdown) and write the memory record."""
        if context.step_time and (self.slow_from is None or self.iteration < self.slow_from):
            self.step_times = [*self.step_times[-(_BEFORE_SLOW - 1) :], context.step_time]
        if self.memory_path is None:
            return
        import torch

        if self.params is None:
            self.params = sum(p.numel() for chunk in context.model for p in chunk.parameters())
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        record = {
            "attempt": self.attempt,
            "pid": os.getpid(),
            "iteration": self.iteration,
            "params": self.params,
            "allocated": torch.cuda.memory_allocated() if cuda else None,
            "reserved": torch.cuda.memory_reserved() if cuda else None,
        }
        with open(self.memory_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def burn(self) -> None:
        """The extra work of one forward pass of a slowed step (nothing in the others)."""
        self.calls += 1
        if not self.slowed:
            return
        import torch

        a, b, out = self._operands
        if self.extra_seconds is None:
            for _ in range(self.products):
                torch.mm(a, b, out=out)
            return
        # On CPU the pass runs products until its extra wall time is spent: a count sized once would add less time
        # whenever the load on a shared CPU falls after it was measured, and the slowdown would not show.
        until = time.perf_counter() + self.extra_seconds
        while time.perf_counter() < until:
            torch.mm(a, b, out=out)

    def _size_extra_work(self) -> None:
        import torch

        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        n, dtype = (4096, torch.bfloat16) if cuda else (192, torch.float32)
        a = torch.full((n, n), 1.0 / n, dtype=dtype, device=device)
        b = torch.full((n, n), 1.0, dtype=dtype, device=device)
        out = torch.empty((n, n), dtype=dtype, device=device)
        self._operands = (a, b, out)
        for _ in range(3):  # warm-up: the first product pays for library set-up
            torch.mm(a, b, out=out)
        repeats = 20
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(repeats):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            unit = begin.elapsed_time(end) / 1000 / repeats
        else:
            start = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, b, out=out)
            unit = (time.perf_counter() - start) / repeats
        step = statistics.median(self.step_times) if self.step_times else unit
        self.products = max(1, round((self.factor - 1) * step / unit / self.calls_per_step))
        if not cuda:
            self.extra_seconds = (self.factor - 1) * step / self.calls_per_step
        print(
            f"[gpu_check_worker] slowing every step from iteration {self.iteration}: {self.products} extra "
            f"{n}x{n} products of {unit * 1e3:.3f} ms in each of its {self.calls_per_step} forward passes on "
            f"{device} (median step before: {step * 1e3:.1f} ms, factor {self.factor:g})",
            flush=True,
        )


def main() -> None:
    """Pretrain the recipe ``sys.argv[1]`` with the overrides that follow, the probes attached."""
    from megatron.bridge.recipes.run import find_recipe
    from megatron.bridge.training import gpt_step
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.pretrain import main as pretrain_main

    probe = Probe()

    class ProbeCallback(Callback):
        def on_train_start(self, context: Any) -> None:
            probe.on_train_start(context)

        def on_train_step_start(self, context: Any) -> None:
            probe.on_train_step_start(context)

        def on_train_step_end(self, context: Any) -> None:
            probe.on_train_step_end(context)

    def forward_step(state: Any, data_iterator: Any, model: Any) -> Any:
        probe.burn()
        return gpt_step.forward_step(state, data_iterator, model)

    pretrain_main(find_recipe(sys.argv[1]), forward_step, sys.argv[2:], callbacks=[ProbeCallback()])


if __name__ == "__main__":  # the guard matters: checkpoint writers spawn helper processes that import this file
    main()
