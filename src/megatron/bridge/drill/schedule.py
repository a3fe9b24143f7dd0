"""The drill's fault schedule: which faults strike where, checked against the run before anything starts.

A schedule is a fault spec (``training/faults/spec.py``, the grammar of ``fault_injection.faults`` and
``$MBRIDGE_FAULTS``, read by the same parser), limited to the kinds whose detection and recovery the drill can tell
apart, each at an iteration, on a rank, in its kind's default phase: ``<kind>@<iteration>:<rank>[:x<factor>]``.

- ``kill``: the rank SIGKILLs itself when it starts the iteration (a crashed process or a lost node);
- ``hang``: the rank SIGSTOPs itself (a hung GPU or a deadlock; the process is alive but makes no progress, and
  answers nothing: in-process restart cannot abort it, so it falls through to a kill and the launcher's restart);
- ``stall``: the rank stops making progress inside a step while its threads go on (blocked on a lock, a store or a
  peer), and its peers wait in a collective with it: in-process restart aborts every rank and trains on in place;
- ``preempt``: the rank receives SIGTERM, as from a scheduler preempting the job;
- ``nan``: the rank's loss is NaN in the first pass of the iteration (a transient numerical fault);
- ``slow``: the rank's forward steps take ``factor`` times as long from that iteration on; the drill needs a factor
  of at least :data:`SLOW_MIN_FACTOR` (``x6`` in :data:`DEFAULT`: a relative score near 0.14, half the drill's
  threshold of 0.3, which healthy ranks stay well above even on a machine that other processes load: 0.58 at the
  lowest there);
- ``corrupt-local``: once the rank's local checkpoint of the iteration is written, bytes in the middle of its file
  are flipped, as a failing disk would; a later restart must find it bad and fall back to the global tier.

A schedule may also hold mutations: broken resumes on purpose, which nothing detects or recovers, to prove that the
comparison with the fault-free run catches what they break (a drill with one fails, naming the difference):

- ``no-rng-restore``, ``no-optimizer-restore``, ``no-data-restore``: as the rank loads the checkpoint of the
  iteration, it leaves its random generators, its optimizer state, or its data position (the data stream starts
  again at the first sample) as its fresh start made them.

The schedule goes to the training processes as it is (``fault_injection.faults``), each fault striking once per job
thanks to the ledger (``fault_injection.ledger``); the tables below are keyed by the same kind names, and read the
parsed :class:`Fault` objects.
"""

from dataclasses import dataclass

from megatron.bridge.training.faults.spec import PHASES, SKIPPED_PART, Fault, number
from megatron.bridge.training.faults.spec import parse as parse_faults

SOURCE = "--faults"
"""How errors name the schedule."""
DEFAULT = "nan@12:1,kill@27:1,preempt@38:0,corrupt-local@45:1,stall@47:1,slow@48:1:x6"
"""One of each kind, for 100 iterations with global saves every 20 and local ones every 5.

The slowed rank is found by comparing it with the others over the steps between two straggler reports. The detector
turns its report interval (seconds) into a number of steps once per start, from the median of its first 16 steps;
``slow`` strikes right after the in-process restart that ``stall`` causes (which loads the corrupted local checkpoint
of 45, rejects it and resumes from the global one of 40), so most of those steps are slowed and the reports
come every few (slowed) steps, whatever the machine's speed. Struck later, with the interval measured on fast steps,
a report could cover more fast steps than slow ones, and the next one come after the end of the run.

Six times slower is a straggler a person would notice in a step-time plot, not an extreme one: each slowed step the
detector needs costs five steps' time, which made the slowed rank the costliest fault of the drill at twenty times
(about 7 s of 12-14 s). The drill's threshold (:data:`STRAGGLER_THRESHOLD`) sits about twice below the healthy
ranks' lowest scores and twice above the slowed rank's."""

MUTATIONS = SKIPPED_PART
"""Mutation kinds and the part each leaves unrestored (the registry's broken-resume kinds).

Not faults: no mechanism is meant to detect them, the fault table leaves them out, and a drill whose final state
still equals the reference's after one struck has a comparison that does not bite."""
KINDS = ("kill", "hang", "stall", "preempt", "nan", "slow", "corrupt-local")
"""The fault kinds a drill schedule may hold (besides :data:`MUTATIONS`)."""
RESTARTING = ("kill", "hang", "preempt", "slow")
"""Kinds after which ft_launcher restarts the workers (``slow``: the straggler stop, exit 21, then the in-job
restart)."""
RELOADING = (*RESTARTING, "stall")
"""Kinds after which training resumes from a checkpoint (``stall``: in the same processes)."""
SLOW_MARGIN = 20
"""Iterations a ``slow`` fault needs before the end: two straggler reports in a row (every second, counted in steps
from the median of the first 16 steps of each start) whose steps are mostly slowed must come before it."""
STRAGGLER_THRESHOLD = 0.3
"""The relative score under which the drill's straggler detection flags a rank (``cli.training_overrides``)."""
SLOW_MIN_FACTOR, SLOW_MAX_FACTOR = 4.0, 100.0
"""The ``slow`` factors a drill accepts: at x4 a rank scores about 0.24 against a healthy 0.96, under
:data:`STRAGGLER_THRESHOLD` (the registry's default x2 scores about 0.5 and is never flagged); past x100 the slowed
steps alone outlast the drill's timeout."""


@dataclass(frozen=True)
class Plan:
    """The run the schedule is checked against."""

    train_iters: int
    nproc: int
    save_interval: int
    local_interval: int
    max_restarts: int


def parse(spec: str) -> list[Fault]:
    """Read a schedule (``"none"`` or empty: no faults; ``"default"``: :data:`DEFAULT`), sorted by iteration.

    The text goes through the one fault parser (``faults/spec.py``); what it returns is then held to what a drill
    can tell apart.

    Raises:
        ValueError: an item is malformed or not one the drill can run (naming it, the drill's kinds and the fix), or
            two faults share an iteration.
    """
    spec = {"default": DEFAULT, "none": ""}.get(spec.strip(), spec)
    faults = parse_faults(spec, SOURCE)
    for fault in faults:
        problem, fix = _unfit(fault)
        if problem:
            raise ValueError(f"{SOURCE}: bad item {fault.label!r}: {problem}. Fix: {fix}")
    faults.sort(key=lambda f: f.iteration)
    seen = [f.iteration for f in faults if f.kind not in MUTATIONS]
    if len(set(seen)) != len(seen):
        raise ValueError(f"{SOURCE}: two faults at the same iteration cannot be told apart in the report; move one")
    return faults


def _unfit(fault: Fault) -> tuple[str, str]:
    """Why the drill cannot run ``fault`` (empty when it can), and the fix."""
    fix = (
        f"write each item as <kind>@<iteration>:<rank>[:x<factor>] with a kind among {', '.join(KINDS)} or a "
        f"mutation among {', '.join(MUTATIONS)}"
    )
    if fault.kind not in KINDS and fault.kind not in MUTATIONS:
        return f"the drill cannot tell what detects and recovers {fault.kind!r}", fix
    if fault.seconds is not None:
        return "a drill's fault strikes at an iteration, not after a time", fix
    if fault.always or fault.phase != PHASES[fault.kind][0]:
        return f"a drill's fault strikes once, in its kind's phase ({PHASES[fault.kind][0]}): no options", fix
    if fault.kind == "slow" and not SLOW_MIN_FACTOR <= fault.scale < SLOW_MAX_FACTOR:
        low, high = number(SLOW_MIN_FACTOR), number(SLOW_MAX_FACTOR)
        return (
            f"x{number(fault.scale)} is outside the drill's x{low} to x{high} (under x{low} the straggler threshold "
            f"{STRAGGLER_THRESHOLD} flags no one; past x{high} the run outlasts its timeout)",
            f"give a factor, e.g. slow@{fault.iteration}:{fault.rank}:x6",
        )
    return "", ""


def check(faults: list[Fault], plan: Plan) -> None:
    """Reject a schedule that cannot play out as written on this run.

    Raises:
        ValueError: naming the fault and the fix.
    """
    for i, fault in enumerate(faults):
        if not 1 <= fault.iteration < plan.train_iters:
            raise ValueError(f"--faults: {fault.label} is outside 1..{plan.train_iters - 1} (--train-iters)")
        if fault.rank >= plan.nproc:
            raise ValueError(f"--faults: {fault.label} names rank {fault.rank}, but the drill runs {plan.nproc} ranks")
        if fault.kind == "slow" and (plan.nproc < 2 or fault.iteration > plan.train_iters - SLOW_MARGIN):
            raise ValueError(
                f"--faults: {fault.label}: a slow rank is found by comparing it with the others, over a few reports: "
                f"it needs 2 or more ranks and {SLOW_MARGIN} iterations after it (at most iteration "
                f"{plan.train_iters - SLOW_MARGIN})"
            )
        if fault.kind in MUTATIONS:
            _check_mutation(fault, faults, plan)
        if fault.kind != "corrupt-local":
            continue
        if fault.iteration % plan.local_interval or not fault.iteration % plan.save_interval:
            raise ValueError(
                f"--faults: {fault.label}: iteration {fault.iteration} has no local checkpoint (local saves every "
                f"{plan.local_interval}, except at the global saves every {plan.save_interval}); pick one that has"
            )
        restart = next((f for f in faults[i + 1 :] if f.kind in RELOADING), None)
        if restart is None or restart.iteration > fault.iteration + plan.local_interval:
            raise ValueError(
                f"--faults: {fault.label}: no restart follows before the next local save at iteration "
                f"{fault.iteration + plan.local_interval}, so nothing would ever load the corrupted checkpoint; "
                "schedule a kill, a hang or a stall in between"
            )
        if restart.kind == "slow" or restart.kind == "preempt":
            raise ValueError(
                f"--faults: {fault.label} is followed by {restart.label}, which saves a newer checkpoint before the "
                "restart; follow it with a kill, a hang or a stall"
            )
    restarts = sum(f.kind in RESTARTING for f in faults)
    if restarts > plan.max_restarts:
        raise ValueError(
            f"--faults: {restarts} faults restart the job but --max-restarts={plan.max_restarts}; raise it"
        )


def _check_mutation(mutation: Fault, faults: list[Fault], plan: Plan) -> None:
    """A mutation strikes at the load of the checkpoint of its iteration: a restart must load that one.

    That is a preemption's own save (``preempt`` at the same iteration), or a checkpoint of that iteration (local or
    global) followed by a kill, hang or stall before the next checkpoint.
    """
    if any(f.kind == "preempt" and f.iteration == mutation.iteration for f in faults):
        return
    it, nxt = mutation.iteration, mutation.iteration + 1
    while nxt % plan.local_interval and nxt % plan.save_interval:
        nxt += 1
    restart = next((f for f in faults if f.kind in ("kill", "hang", "stall") and it < f.iteration <= nxt), None)
    if (it % plan.local_interval and it % plan.save_interval) or restart is None:
        raise ValueError(
            f"--faults: {mutation.label} strikes when a restart loads the checkpoint of iteration {it}, and none "
            f"would: schedule preempt@{it}:<rank> (it saves there), or put it at a checkpoint's iteration (local "
            f"every {plan.local_interval}, global every {plan.save_interval}) with a kill, hang or stall after it "
            "and before the next checkpoint"
        )


def worker_faults(faults: list[Fault]) -> str:
    """The ``fault_injection.faults`` spec of the schedule: its faults, as the training processes parse them."""
    return ",".join(str(f) for f in faults)
