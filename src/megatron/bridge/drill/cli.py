"""``python -m megatron.bridge.drill``: the resiliency drill from the command line.

    python -m megatron.bridge.drill [--faults default|none|<schedule>] [--train-iters 100] [--run-dir runs/main_job]
        [--no-reference | --reference-run <an earlier drill's run dir>] [-- <dotted overrides for both runs>]

Exit code 0 when the job finished, every fault was detected and recovered, and the final state equals the
fault-free run's; 1 otherwise; 2 for a bad schedule or argument.
"""

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from megatron.bridge.drill import events, report, runner, schedule
from megatron.bridge.drill.schedule import Plan
from megatron.bridge.training.config_checks.resiliency import INPROCESS_ENV
from megatron.bridge.training.faults import spec as fault_spec
from megatron.bridge.training.faults.spec import Fault
from megatron.bridge.utils import provenance

if TYPE_CHECKING:  # the comparison imports torch: only when the drill compares
    from megatron.bridge.training.checkpoint.compare import PartCount

logger = logging.getLogger(__name__)

ENTRY = ("megatron.bridge.recipes.run", "llama3_tiny_pretrain_config")
"""What each rank runs (``python -m``): the CPU-sized Llama recipe, which ships in the package."""
MODEL_OVERRIDES = ("model.pipeline_model_parallel_size=2", "dataset.num_workers=0",
                   "model.hidden_dropout=0.1", "model.attention_dropout=0.1")  # fmt: skip
"""The drill's layout, before the user's overrides (which may change them): two pipeline stages; batches read in the
training process (loader workers are fresh interpreters that would compete with the ranks for 2 cores at every
restart; the exact-resume drills run with them).

Dropout on (the Llama recipe has none): every step of every stage then draws from the random generators (hidden
dropout from torch's, attention dropout from megatron-core's tracker), so a resume that does not restore each rank's
generators trains on with other masks and the final state differs. Without dropout nothing draws from them during
training, and "final state equal (model, optimizer, RNG)" could not fail on the RNG."""
CORPUS_BYTES = 2_000_000
"""Text of the drill's corpus: the first Python standard library sources, byte-level tokenized."""
WORKERS_STOP_TIMEOUT = 0.5
"""Seconds ft_launcher waits for the survivors to exit after its SIGTERM before it SIGKILLs them (restart teardown)."""
FT_LAUNCHER = "megatron.bridge.ft_launch"
"""ft_launcher without its port race (``python -m``), run by the drill's own interpreter (see :func:`_ft_launcher`)."""


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m megatron.bridge.drill", description=__doc__.splitlines()[0])
    p.add_argument(
        "--faults",
        default="default",
        help=f"a fault spec, as fault_injection.faults and ${fault_spec.ENV} take it: "
        f"<kind>@<iteration>:<rank>[:x<factor>],... with kind in {', '.join(schedule.KINDS)} (x<factor>: slow only, "
        f"{schedule.SLOW_MIN_FACTOR:g} to {schedule.SLOW_MAX_FACTOR:g}), or a mutation "
        f"({', '.join(schedule.MUTATIONS)}: a resume that leaves that part unrestored, to show that the comparison "
        f"catches it); 'default' ({schedule.DEFAULT}) or 'none'",
    )
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    p.add_argument("--run-dir", type=Path, default=Path("runs/main_job"), help="emptied first")
    p.add_argument("--save-interval", type=int, default=20, help="global (async) checkpoints")
    p.add_argument("--local-interval", type=int, default=5, help="local-tier checkpoints")
    p.add_argument("--max-restarts", type=int, default=None, help="default: restarting faults + 2")
    p.add_argument(
        "--step-timeout",
        type=float,
        default=5.0,
        help="ft step timeout until one is learned (s; below hard_timeout: raised to it)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="kill a run (and its ranks) after this many seconds")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free run (no equality check)")
    p.add_argument("--data", default=None, help="a dataset prefix to train on (default: a corpus made offline)")
    p.add_argument(
        "--reference-run",
        type=Path,
        default=None,
        help="compare with the fault-free run of an earlier drill (its --run-dir) made with the same settings "
        "and --data, instead of running one",
    )
    return p.parse_args(argv), overrides


RESERVED = ("train.train_iters", "checkpoint.", "logger.", "ft.", "nvrx_straggler.", "rerun_state_machine.",
            "train.exit_signal_handler", "health.", "inprocess_restart.", "fault_injection.",
            "dataset.blend")  # fmt: skip
"""Override prefixes the drill sets itself: its analysis depends on them (a step log line per iteration, say)."""
_MARKER = ".mbridge-drill"


def _check_overrides(overrides: list[str]) -> None:
    """Reject overrides of what the drill controls (use its own options instead)."""
    for item in overrides:
        if item.split("=", 1)[0].startswith(RESERVED):
            raise ValueError(
                f"override {item!r}: the drill sets {item.split('=', 1)[0]} itself (its report depends on it); "
                "use --train-iters, --save-interval, --local-interval, --data, or a model/optimizer/train field"
            )


def _prepare_run_dir(run_dir: Path) -> None:
    """Empty ``run_dir`` for a new drill, but only if it is empty or an earlier drill's (never a random folder)."""
    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / _MARKER).exists():
        raise ValueError(f"--run-dir {run_dir} is not empty and not an earlier drill's; choose another or empty it")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / _MARKER).write_text("a resiliency drill's run directory: emptied by the next drill\n")


REFERENCE_SETTINGS = "drill_settings.json"
"""In a drill's ``reference/``: the settings its fault-free run was made with, and its wall time (for a later drill's
``--reference-run``)."""


def _settings(args: argparse.Namespace, overrides: list[str]) -> dict:
    """What decides the final state of a fault-free run (the launcher's restart budget does not)."""
    keys = ("train_iters", "nproc", "save_interval", "local_interval", "step_timeout")
    return {**{k: getattr(args, k) for k in keys}, "data": str(Path(args.data).resolve()), "overrides": overrides}


def _earlier_reference(args: argparse.Namespace, overrides: list[str]) -> tuple[Path, float, events.Timeline]:
    """The fault-free run of the drill in ``--reference-run``: its directory, wall seconds and timeline.

    Raises:
        ValueError: there is none, or it was made with other settings (its final state would differ anyway).
    """
    ref = args.reference_run / "reference"
    if args.no_reference or args.reference_run.resolve() == args.run_dir.resolve():
        raise ValueError("--reference-run: give another drill's --run-dir, and not with --no-reference")
    try:
        saved = json.loads((ref / REFERENCE_SETTINGS).read_text())
    except (OSError, ValueError):
        raise ValueError(f"--reference-run {args.reference_run}: no finished fault-free run there") from None
    wanted = _settings(args, overrides)
    changed = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in wanted.items() if saved.get(k) != v]
    if changed:
        raise ValueError(
            f"--reference-run {args.reference_run}: its fault-free run had other settings ({'; '.join(changed)}); "
            "use the same ones (--data too), or leave --reference-run out"
        )
    return ref, float(saved["wall_s"]), events.read_run(ref / "events")


def _ft_launcher() -> list[str]:
    """The ft_launcher command, run by this interpreter: its workers then import this same installation.

    (An ``ft_launcher`` script found on ``PATH`` may belong to another environment, e.g. a source checkout's.)
    """
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        raise SystemExit("ft_launcher not found: install nvidia-resiliency-ext (bash scripts/setup_env.sh)")
    return [sys.executable, "-m", FT_LAUNCHER]


def prepare_corpus(data_dir: Path) -> str:
    """A small real corpus made with no network: standard library sources, byte-level tokenized; its prefix."""
    from megatron.bridge.data.offline_corpus import write_corpus
    from megatron.bridge.data.preprocess import preprocess
    from megatron.bridge.data.tokenization import build_tokenizer
    from megatron.bridge.recipes.llama.llama3 import BYTE_LEVEL
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    jsonl, prefix = data_dir / "corpus.jsonl", data_dir / "stdlib_text_document"
    files, size = write_corpus(str(jsonl), max_bytes=CORPUS_BYTES)
    stats = preprocess(
        str(jsonl), str(prefix), build_tokenizer(TokenizerConfig(metadata_path=dict(BYTE_LEVEL))), append_eod=True
    )
    print(f"[drill] corpus: {files} standard library sources, {stats.tokens:,} byte-level tokens -> {prefix}")
    return str(prefix)


def training_overrides(args: argparse.Namespace, run: Path, tensorboard: Path) -> list[str]:
    """The drill's data and every resiliency feature on, in-process restart layered inside in-job restart.

    The rank monitor's sections, preemption handling and the liveness ping work in every layer.

    In-process restart declares a rank hung after 3 s without progress (a finished step, save or setup phase: a step
    takes well under a second here, a blocking save or a setup phase about one under load), gathers the other ranks'
    faults for 0.3 s, and terminates a rank it cannot abort after 6 s (3 s to unwind after the soft abort); its
    monitor process looks every 0.5 s, its monitor thread every 0.1 s (a finishing rank waits for that thread: at
    0.5 s the exits before the launcher's restarts took 0.45 s longer). The rank monitor's step timeout is kept
    above the 6 s (``fault_tolerance.py``). After 4 restarts in place, in-process restart gives up (exit 22) and the
    launcher restarts the job: a fault that recurs in every iteration (a broken build, a config the run cannot
    start with) ends the drill instead of restarting in place forever.

    Straggler detection stops the job on a rank scoring below 0.3 against the fastest one in two reports in a row.
    The default schedule's rank slowed six times scores about 0.14; healthy ranks scored 0.72-0.96 on an idle
    machine and down to 0.58 with three busy processes beside the drill (the last pipeline stage does the most work;
    a false stop costs a restart). The score against a rank's own history is off: on a shared CPU machine it follows
    the machine's load (healthy ranks fell to 0.24 while other jobs ran).
    """
    return [
        f"dataset.blend=[[{args.data!r}],None]",
        f"train.train_iters={args.train_iters}",
        f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.load={run / 'checkpoints'}",
        f"checkpoint.save_interval={args.save_interval}", "checkpoint.async_save=true", "checkpoint.most_recent_k=-1",
        f"checkpoint.non_persistent_save_interval={args.local_interval}", "checkpoint.non_persistent_ckpt_type=local",
        f"checkpoint.non_persistent_local_ckpt_dir={run / 'local'}",
        "ft.enable_ft_package=true", "ft.calc_ft_timeouts=true",
        "rerun_state_machine.rerun_mode=validate_results",
        "nvrx_straggler.enabled=true", "nvrx_straggler.report_time_interval=1", "nvrx_straggler.stop_if_detected=true",
        f"nvrx_straggler.gpu_relative_perf_threshold={schedule.STRAGGLER_THRESHOLD}",
        "nvrx_straggler.calc_individual_gpu_perf=false", "nvrx_straggler.stop_after_consecutive_reports=2",
        "train.exit_signal_handler=true",
        "health.liveness_ping_interval=10", "health.liveness_ping_timeout=30",
        "inprocess_restart.enabled=true", "inprocess_restart.max_iterations=4",
        "inprocess_restart.soft_timeout=3", "inprocess_restart.hard_timeout=6",
        "inprocess_restart.last_call_wait=0.3", "inprocess_restart.monitor_thread_interval=0.1",
        "inprocess_restart.monitor_process_interval=0.5", "inprocess_restart.progress_watchdog_interval=1",
        "inprocess_restart.heartbeat_interval=1", "inprocess_restart.heartbeat_timeout=4",
        "inprocess_restart.barrier_timeout=60", "inprocess_restart.completion_timeout=60",
        f"inprocess_restart.monitor_process_logdir={run / 'inprocess'}",
        "logger.log_interval=1", f"logger.tensorboard_dir={tensorboard}",
    ]  # fmt: skip


def _train(
    args: argparse.Namespace,
    run: Path,
    label: str,
    faults: list[Fault],
    overrides: list[str],
    max_restarts: int,
) -> tuple[int, float, events.Timeline]:
    """One training job under ft_launcher; returns (exit code, wall seconds, what its event stream says)."""
    run.mkdir(parents=True, exist_ok=True)
    ledger = run / "fault_ledger.jsonl"
    event_dir = (run / "events").resolve()  # the launcher's and the ranks' events, the report's only source
    spec = schedule.worker_faults(faults)  # the schedule itself, injected inside the ranks, once per job (the ledger)
    cmd = [
        *_ft_launcher(), f"--nproc-per-node={args.nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={max_restarts}",
        f"--ft-rank-section-timeouts=setup:300,step:{args.step_timeout:g},checkpointing:120",
        "--ft-rank-out-of-section-timeout=120", "--ft-workload-check-interval=1", "--ft-safety-factor=30",
        # Survivors trap SIGTERM (preemption handling) and in-process restart keeps them busy: the launcher's stop
        # before a restart would wait its default 30 s for them; their work since the last checkpoint is lost anyway.
        f"--workers-stop-timeout={WORKERS_STOP_TIMEOUT:g}", f"--event-dir={event_dir}",
        "-m", *ENTRY, *MODEL_OVERRIDES, *training_overrides(args, run, args.run_dir / "tensorboard" / label),
        *overrides,
        f"fault_injection.ledger={ledger}", f"health.event_dir={event_dir}",
        *([f"fault_injection.faults={spec}"] if spec else []),
    ]  # fmt: skip
    start, began = time.time(), time.monotonic()  # the job's start (a timestamp), and its duration's start
    env = {
        **{k: v for k, v in os.environ.items() if k != fault_spec.ENV},  # the schedule is the only faults
        "PYTHONUNBUFFERED": "1",
        **INPROCESS_ENV,  # what in-process restart needs in the ranks' environment
        "MBRIDGE_JOB_START_TIME": f"{start:.3f}",
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning"),
    }
    log_path = run / "train.log"
    code = runner.launch_and_watch(cmd, env, log_path, args.timeout, label)
    return code, time.monotonic() - began, events.read_run(event_dir)


def _final_summary(path: Path, train_iters: int) -> Optional[dict]:
    """The job's goodput summary, if the attempt that wrote it finished training (not one an earlier attempt left)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("iteration") == train_iters else None


def _compare(reference: Path, drill: Path) -> tuple[Optional[bool], list[str], list["PartCount"]]:
    """Whether the drill's final checkpoint equals the reference's, what differs or is missing, what was compared."""
    from megatron.bridge.training.checkpoint import compare, manifest

    for path in (reference, drill):
        if not (path / manifest.MANIFEST_NAME).exists():  # written at the commit, whatever the upstream format
            return False, [f"{path} holds no committed checkpoint"], []
    try:
        a, b = compare.checkpoint_state(reference), compare.checkpoint_state(drill)
    except Exception as err:  # noqa: BLE001 - an unreadable checkpoint is a failed comparison, reported as such
        return False, [f"could not read the final checkpoints: {type(err).__name__}: {err}"], []
    result = compare.compare_states(a, b, names=("fault-free run's checkpoint", "drill's checkpoint"))
    return result.equal, result.differences, result.parts


def main(argv: Optional[list[str]] = None) -> int:
    """Run the drill; return its exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, overrides = _args(sys.argv[1:] if argv is None else argv)
    measured_on = provenance.collect()  # the drill's date, machine and commit, for its report
    try:
        faults = schedule.parse(args.faults)
        restarting = sum(f.kind in schedule.RESTARTING for f in faults)
        max_restarts = args.max_restarts if args.max_restarts is not None else restarting + 2
        plan = Plan(args.train_iters, args.nproc, args.save_interval, args.local_interval, max_restarts)
        schedule.check(faults, plan)
        _check_overrides(overrides)
        _prepare_run_dir(args.run_dir)
        if args.data is None:
            args.data = prepare_corpus(args.run_dir / "data")
        earlier = _earlier_reference(args, overrides) if args.reference_run is not None else None
    except ValueError as err:
        print(f"drill: {err}", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    print(
        f"[drill] {args.nproc} ranks, {args.train_iters} iterations under ft_launcher, every feature on "
        "(in-process restart inside in-job restart)"
    )
    print(f"[drill] faults: {', '.join(f.label for f in faults) or 'none'}; max restarts {max_restarts}")
    reference_dir, reference_wall, reference_timeline = run_dir / "reference", None, None
    if earlier is not None:
        reference_dir, reference_wall, reference_timeline = earlier
        print(f"[drill] 1/2: the fault-free reference run of {args.reference_run} (same settings)", flush=True)
    elif not args.no_reference:
        print("[drill] 1/2: the fault-free reference run (same seed, same features)", flush=True)
        code, reference_wall, reference_timeline = _train(args, reference_dir, "reference", [], overrides, max_restarts)
        if code != 0:
            print(f"[drill] the reference run failed (exit {code}); see {reference_dir / 'train.log'}")
            return 1
        settings = {**_settings(args, overrides), "wall_s": reference_wall}
        (reference_dir / REFERENCE_SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
    print("[drill] 2/2: the run with faults", flush=True)
    code, wall, timeline = _train(args, run_dir, "drill", faults, overrides, max_restarts)
    found = events.outcomes(timeline, faults)
    final = f"iter_{args.train_iters:07d}"
    equal, diffs, compared = (None, [], [])
    if reference_timeline is not None:
        equal, diffs, compared = _compare(reference_dir / "checkpoints" / final, run_dir / "checkpoints" / final)
    summary = run_dir / "checkpoints" / "goodput" / "summary.json"
    reference_summary = reference_dir / "checkpoints" / "goodput" / "summary.json"
    result = report.DrillResult(
        outcomes=found,
        timeline=timeline,
        exit_code=code,
        wall_s=wall,
        reference_wall_s=reference_wall,
        goodput=_final_summary(summary, args.train_iters),
        equal=equal,
        differences=diffs,
        compared=compared,
        unexplained_restarts=events.unexplained_restarts(timeline, found),
        final_iteration=max((it for _, it, _ in timeline.steps), default=None),
        reference_goodput=json.loads(reference_summary.read_text()) if reference_summary.exists() else None,
        mutations=events.mutation_outcomes(timeline, faults),
        provenance=measured_on,
    )
    return _finish(result, run_dir, reference_timeline)


def _finish(result: report.DrillResult, run_dir: Path, reference: Optional[events.Timeline]) -> int:
    from megatron.bridge.drill import plot

    text = "\n".join(
        [
            "",
            "## Resiliency drill",
            "",
            report.fault_table(result),
            "",
            *report.goodput_lines(result),
            *report.mutation_lines(result),
            report.equality_line(result),
            f"training job exit code {result.exit_code}; drill {'PASSED' if result.passed else 'FAILED'}",
        ]
    )
    print(text)
    (run_dir / "drill_report.md").write_text(text.lstrip() + "\n")
    report.save_json(result, run_dir / "drill_report.json")
    report.write_tensorboard(result, run_dir / "tensorboard" / "drill_summary")
    try:
        plot.timeline_png(run_dir / "timeline.png", result.timeline, result.outcomes, reference)
        plotted = f", timeline {run_dir / 'timeline.png'}"
    except ImportError as err:
        plotted = f"; no timeline plot ({err})"
    print(
        f"files: report {run_dir / 'drill_report.md'} and .json, TensorBoard {run_dir / 'tensorboard'}, "
        f"log {run_dir / 'train.log'}, checkpoints {run_dir / 'checkpoints'}{plotted}"
    )
    return 0 if result.passed else 1
