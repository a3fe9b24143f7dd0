"""The one grammar of injected faults: which failure to simulate, on which rank, when and where, read by :func:`parse`.

Every failure the registry (``faults/injection.py``) simulates for real is written the same way wherever it comes
from: the config field ``fault_injection.faults``, the environment variable ``$MBRIDGE_FAULTS`` (launcher-driven
runs), the drill's ``--faults`` (``drill/schedule.py``) and ``ft.simulate_fault*`` (``fault_tolerance.py``). Each
goes through :func:`parse`, so a kind has one name everywhere, in the ledger and in the ``fault_injected`` events too.

Spec: a comma-separated list of ``<kind>@<when>:<rank>[:<phase>][:x<factor>][:always]``, e.g.
``kill@8:1,nan@12:0,slow@1:1:x3,kill@6:1:save.during_write,nan@8:0:local_save,hang@4s:1,no-rng-restore@6:1``.

- ``when``: the iteration (1-based, the one the rank is about to run or save), or ``<seconds>s``: that many
  seconds after the rank starts training, wherever it is then (phase ``timer``).
- ``rank``: the global rank that fails.
- ``kind`` and its phases (the first listed is its default):

  - ``hang`` (SIGSTOP: a hung GPU, a deadlock), ``kill`` (SIGKILL: a crashed process or a lost node), ``preempt``
    (SIGTERM: a scheduler preempting the job), ``preempt-tree`` (SIGTERM to the rank and every process it started,
    as Slurm signals a job step): ``step``, ``save.<point>``, ``timer``;
  - ``exception`` (an uncaught ``RuntimeError``), ``stall`` (the rank stays alive but makes no progress, waiting
    with the GIL released, as a rank blocked on a lock, a store, a peer or storage that stops answering; its
    threads and heartbeats go on): ``step``, ``save.<point>``;
  - ``slow`` (the rank's forward steps take ``x<factor>`` times as long, default 2, from that iteration on: it
    sleeps for the extra time inside the step, which CPU-side timing sees and CUDA kernel timing does not; the
    extra time is a multiple of the median of the rank's recent forward times, so a single forward step that
    other processes delay is not stretched ``factor`` times more),
    ``spike`` (its forward output is multiplied by ``x<factor>``, default 100): ``forward``;
  - ``nan``: ``forward`` (its forward output becomes NaN, hence its loss and gradients), ``local_save`` (its
    local checkpoint of that iteration is saved with NaN weights: a poisoned local checkpoint);
  - ``corrupt-local``: ``local_save`` (once the rank's local checkpoint of that iteration is written, 64 bytes in
    the middle of its file are flipped: storage that damages data at rest, which the content hashes catch at load);
  - ``fill``: ``global_save``, ``local_save`` (the file system of ``checkpoint.save``, or of the local tier's
    directory, is filled up to ``effects.FILL_LEAVES`` free bytes with the file ``effects.FILL_FILE`` in that
    directory, just before the rank's files of that iteration's save are written and after the free-space check:
    a disk that fills up during a save; delete the file to free the space);
  - ``oom`` (the rank allocates and touches host memory, 64 MiB at a time, until the kernel's out-of-memory killer
    kills it with SIGKILL: the kill comes from the kernel, never from the rank. It needs a memory limit, as Slurm's
    ``--mem`` sets: it stops at the limit of its memory cgroup plus 256 MiB, or at 2 GiB where it finds none, and
    then raises a ``RuntimeError`` saying that nothing killed it), ``clock-jump`` (this process's wall clock,
    ``time.time()`` and ``time.time_ns()``, jumps by ``x<factor>`` hours, default 1, negative for backwards, from
    then on; the monotonic clocks do not move: an NTP step or a mis-set clock, seen by this rank only): ``step``;
  - ``bitflip``: ``update`` (after the optimizer step of that iteration, one bit of one element in the middle of the
    rank's largest parameter tensor is flipped in place: silent data corruption of one replica's weights, which
    ``train.check_weight_hash_across_dp_replicas_interval`` finds; a mantissa bit, so the loss stays finite);
  - ``io-error`` (the save fails with ``EIO``, as a flaky or overloaded file server makes it fail; ``x<N>``: the
    first ``N`` attempts of that save fail, default 1, then the retries of ``checkpoint.save_retries`` succeed;
    ``:always``: every attempt fails, a persistent error): ``write`` (the rank's first shard file of the global
    save is cut to half its size and its write fails), ``fsync`` (the file is written whole, its fsync fails),
    ``rename`` (rank 0's commit fails to rename the save's temporary directory to ``iter_N``: nothing is
    published). Attempts are counted in the training process; an async save's ``write`` and ``fsync`` attempts in
    its background writer, which retries them;
  - ``no-rng-restore``, ``no-optimizer-restore``, ``no-data-restore`` (a broken resume on purpose, to prove that a
    comparison with an uninterrupted run catches it: the drill's mutations): ``restore``: as the rank loads the
    checkpoint of that iteration (either tier) it leaves that part as its fresh start made it: every random
    generator keeps this start's seeds; moments, step counts and master weights stay as built; the training data
    stream starts at the first sample (the consumed-sample count itself is restored).

- ``phase``: ``step``: when the rank starts the iteration. ``forward``: in the rank's forward passes of the
  iteration. ``save.<point>``: at that point of the global checkpoint's commit protocol in the save of that
  iteration (points in :data:`SAVE_POINTS`: a crash, hang or stall during a save; only rank 0 commits, so every
  point after ``during_write`` needs rank 0). ``local_save``: before the local checkpoint's content hashes are
  computed, so it verifies (a state that is bad although intact, as a replica assembled from the wrong pieces would
  be). ``global_save``: before the rank writes its files of a global checkpoint. ``timer``: goes with
  ``<seconds>s``, from a timer thread (``ft.simulate_fault`` is such a fault). ``restore``: at the load of the
  checkpoint of that iteration. ``update``: right after the optimizer step of that iteration (before any check or save
  of it). ``write``, ``fsync``, ``rename``: in each attempt of the global save of that iteration
  (:data:`IO_PHASES`; ``rename`` needs rank 0).
- ``always``: strike in every attempt, not only the first (``faults/injection.py`` says which attempt a fault
  strikes in, and how the ledger spans restarts).

A malformed item, an unknown kind or an item given twice is a ``ValueError`` naming the source (the config field,
the environment variable, the drill's flag), the item, what is wrong with it and the fix (the form and every kind).
"""

from dataclasses import dataclass
from typing import Optional

ENV = "MBRIDGE_FAULTS"
"""The environment variable of launcher-driven runs; its faults are added to ``fault_injection.faults``."""
CONFIG_FIELD = "fault_injection.faults"
"""The config field of the job's faults (how errors name it)."""
GRAMMAR = "<kind>@<when>:<rank>[:<phase>][:x<factor>][:always] (when: an iteration >= 1 or <seconds>s)"
"""The form of one item, as errors quote it."""

STEP, FORWARD, LOCAL_SAVE, TIMER = "step", "forward", "local_save", "timer"
GLOBAL_SAVE = "global_save"
"""The phase before a rank writes its files of a global checkpoint (after the free-space check)."""
SAVE = "save."
"""Prefix of the phases at a point of the checkpoint commit protocol: ``save.<point>``."""
SAVE_POINTS = (
    "during_write",  # this rank wrote its files, nothing else happened (every rank passes here)
    "after_manifest",  # all files and the manifest are in .tmp_iter_N (rank 0 from here on)
    "after_replace_old",  # an existing iter_N was moved to .replaced_iter_N (a re-save of the same iteration)
    "after_rename",  # iter_N is in place, the tracker still names the previous checkpoint
    "after_tracker_tmp",  # the new tracker is written to its temporary file but not renamed
    "after_tracker",  # committed; .replaced_iter_N (if any) not yet deleted
)
"""The points of ``checkpoint/layout.py``'s commit protocol a ``save.<point>`` fault can strike at."""
RESTORE = "restore"
"""The phase at the load of a checkpoint (the broken-resume kinds)."""
UPDATE = "update"
"""The phase right after the optimizer step of an iteration (``bitflip``)."""
IO_PHASES = ("write", "fsync", "rename")
"""Where an ``io-error`` strikes in an attempt of a global save: a shard's write, its fsync, the commit's rename."""
IO_ERROR = "io-error"
"""The kind of a failing save attempt (``checkpoint.save_retries`` retries it)."""
RESTORE_PARTS = ("rng", "optimizer", "data")
"""What a resume can be made to leave unrestored."""
SKIPPED_PART = {f"no-{part}-restore": part for part in RESTORE_PARTS}
"""The broken-resume kinds, each with the part (:data:`RESTORE_PARTS`) it leaves unrestored."""

_SIGNALLING = (STEP, SAVE, TIMER)
PHASES = {
    "hang": _SIGNALLING,
    "kill": _SIGNALLING,
    "preempt": _SIGNALLING,
    "preempt-tree": _SIGNALLING,
    "exception": (STEP, SAVE),
    "stall": (STEP, SAVE),
    "slow": (FORWARD,),
    "spike": (FORWARD,),
    "nan": (FORWARD, LOCAL_SAVE),
    "corrupt-local": (LOCAL_SAVE,),
    "fill": (GLOBAL_SAVE, LOCAL_SAVE),
    "oom": (STEP,),
    "clock-jump": (STEP,),
    "bitflip": (UPDATE,),
    IO_ERROR: IO_PHASES,
    **dict.fromkeys(SKIPPED_PART, (RESTORE,)),
}
"""Every kind and the phases it can strike in; the first is its default."""
KINDS = tuple(PHASES)
"""Every kind, in the order the module docstring lists them."""
FACTORS = {"slow": 2.0, "spike": 100.0, "clock-jump": 1.0, IO_ERROR: 1.0}
"""Kinds that take ``x<factor>``, and their default factor (``clock-jump``: hours; ``io-error``: failed attempts)."""
_PLAIN_PHASES = (STEP, FORWARD, LOCAL_SAVE, GLOBAL_SAVE, TIMER, RESTORE, UPDATE, *IO_PHASES)


def number(value: float) -> str:
    """``value`` as short as it reads back exactly (``6.0`` -> ``6``)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; constructing one checks it (``ValueError`` naming the bad part)."""

    kind: str
    iteration: Optional[int]
    """The iteration it strikes at; ``None`` for a timed fault (``seconds``)."""
    rank: int
    phase: str = ""
    """Where it strikes (see the module docstring); empty means the kind's default."""
    always: bool = False
    """Strike in every attempt, not only the first (or the first to reach it, with a ledger)."""
    factor: Optional[float] = None
    """``slow``: how many times longer the forward steps take (default 2); ``spike``: the output multiplier
    (default 100); ``clock-jump``: hours (default 1)."""
    seconds: Optional[float] = None
    """A timed fault: seconds after the rank starts training (instead of an iteration; phase ``timer``)."""

    def __post_init__(self) -> None:
        if self.kind not in PHASES:
            raise ValueError(f"unknown kind {self.kind!r} (kinds: {', '.join(KINDS)})")
        timed = self.seconds is not None
        if timed == (self.iteration is not None):
            raise ValueError("give either an iteration or a time in seconds")
        if not self.phase:
            object.__setattr__(self, "phase", TIMER if timed else PHASES[self.kind][0])
        family = SAVE if self.phase.startswith(SAVE) else self.phase
        if family not in PHASES[self.kind]:
            allowed = ", ".join(p + ("<point>" if p == SAVE else "") for p in PHASES[self.kind])
            raise ValueError(f"{self.kind} cannot strike in phase {self.phase!r} (its phases: {allowed})")
        if family == SAVE and self.phase[len(SAVE) :] not in SAVE_POINTS:
            raise ValueError(f"unknown checkpoint point {self.phase!r} (points: save.{', save.'.join(SAVE_POINTS)})")
        if family == SAVE and self.phase != SAVE + SAVE_POINTS[0] and self.rank != 0:
            raise ValueError(f"only rank 0 reaches {self.phase!r} (it commits the checkpoint)")
        if (family == TIMER) != timed:
            raise ValueError("a <seconds>s time goes with phase timer, an iteration with the other phases")
        if timed and not 0 <= self.seconds < float("inf"):
            raise ValueError(f"time {self.seconds}s is not a number of seconds >= 0")
        if not timed and self.iteration < 1:
            raise ValueError(f"iteration {self.iteration} is not >= 1")
        if self.rank < 0:
            raise ValueError(f"rank {self.rank} is not >= 0")
        if self.factor is not None and self.kind not in FACTORS:
            raise ValueError(f"x<factor> is only for {', '.join(FACTORS)}")
        if self.kind == "clock-jump" and self.factor is not None and not 0 < abs(self.factor) < 1e4:
            raise ValueError(f"x{self.factor:g}: a clock jump is a non-zero number of hours, under 10000 either way")
        if self.phase == IO_PHASES[2] and self.rank != 0:
            raise ValueError("only rank 0 renames the save's directory (it commits the checkpoint)")
        if self.kind == IO_ERROR and self.factor is not None and self.factor not in range(1, 1000):
            raise ValueError(f"x{self.factor:g}: an io-error fails a whole number of attempts, 1 to 999")
        if self.kind not in ("clock-jump", IO_ERROR) and self.factor is not None and not 1 < self.factor < 1e3:
            raise ValueError(f"factor {self.factor:g} is not in (1, 1000)")

    @property
    def scale(self) -> float:
        """``factor``, or the kind's default one."""
        return self.factor if self.factor is not None else FACTORS.get(self.kind, 1.0)

    @property
    def default_phase(self) -> bool:
        """It strikes where its kind does unless told otherwise (``timer`` for a timed fault)."""
        return self.phase == (TIMER if self.seconds is not None else PHASES[self.kind][0])

    @property
    def label(self) -> str:
        """How reports and events name it: its spec, e.g. ``kill@27:1`` (``str(fault)``)."""
        return str(self)

    def __str__(self) -> str:
        """The spec of this fault (``parse(str(fault)) == [fault]``)."""
        when = f"{number(self.seconds)}s" if self.seconds is not None else str(self.iteration)
        options = [] if self.default_phase else [self.phase]
        options += [f"x{number(self.factor)}"] if self.factor is not None else []
        options += ["always"] if self.always else []
        return ":".join([f"{self.kind}@{when}", str(self.rank), *options])


def _parse_item(item: str) -> Fault:
    kind, at, rest = item.partition("@")
    if not at:
        raise ValueError("no '@' after the kind")
    if kind not in PHASES:
        raise ValueError(f"unknown kind {kind!r}")
    when, *parts = rest.split(":")
    if not parts:
        raise ValueError("no :<rank> after the iteration")
    iteration = seconds = None
    try:
        if when.endswith("s"):
            seconds = float(when[:-1])
        else:
            iteration = int(when)
    except ValueError:
        raise ValueError(f"{when!r} is neither an iteration nor <seconds>s") from None
    try:
        rank = int(parts[0])
    except ValueError:
        raise ValueError(f"rank {parts[0]!r} is not a whole number") from None
    phase, factor, always = "", None, False
    for option in parts[1:]:
        if option == "always" and not always:
            always = True
        elif option.startswith("x") and factor is None:
            try:
                factor = float(option[1:])
            except ValueError:
                raise ValueError(f"factor {option!r} is not x<number>") from None
        elif (option in _PLAIN_PHASES or option.startswith(SAVE)) and not phase:
            phase = option
        else:
            raise ValueError(
                f"option {option!r} is unknown or given twice (options: a phase {STEP}, {FORWARD}, {SAVE}<point>, "
                f"{GLOBAL_SAVE}, {LOCAL_SAVE}, {TIMER}, {RESTORE}, {UPDATE}, {', '.join(IO_PHASES)}; x<factor>; always)"
            )
    return Fault(kind, iteration, rank, phase, always, factor, seconds)


def parse(spec: str, source: str = ENV) -> list[Fault]:
    """Parse a fault spec (see the module docstring), in order; ``source`` names where it came from in errors.

    Every reader of fault specs calls this one: the config field, the environment variable, the drill's flag and
    ``ft.simulate_fault*``.

    Raises:
        ValueError: ``"<source>: bad item '<item>': <what is wrong>. Fix: write each item as ... (kinds: ...)"``, or
            an item given twice.
    """
    faults: list[Fault] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            faults.append(_parse_item(item))
        except ValueError as err:
            raise ValueError(
                f"{source}: bad item {item!r}: {err}. Fix: write each item as {GRAMMAR}, kind one of {', '.join(KINDS)}"
            ) from None
        if faults[-1] in faults[:-1]:
            raise ValueError(f"{source}: item {item!r} is there twice (a fault strikes once). Fix: remove one")
    return faults
