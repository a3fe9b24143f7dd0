"""Reading an event directory back: typed :class:`~megatron.bridge.training.events.stream.Event` objects, in time order.

The failure it handles: a reader that stops at the first bad line (a line a SIGKILL cut short, a line of a newer
schema, a field of the wrong type) would hide every later fault and restart of the job. Here a bad line becomes a
:class:`Problem` naming its file and line number and is skipped; reading never raises on bad content. The schema and
the writer are in ``events/stream.py`` (:func:`~megatron.bridge.training.events.stream.from_json` checks each line).

Example:
    >>> events, problems = read_events("/runs/job/events")
"""

import glob
import json
import os
import signal
from dataclasses import dataclass

from megatron.bridge.training.events.stream import FILE_GLOB, Event, from_json


@dataclass(frozen=True)
class Problem:
    """A line of an event file that was skipped, and why."""

    path: str
    line: int
    """1-based line number."""
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def read_file(path: str) -> tuple[list[Event], list[Problem]]:
    """The events of one file in file order, and the lines skipped (never raises on bad content)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        return [], [Problem(path, 0, f"cannot read: {err}")]
    events: list[Event] = []
    problems: list[Problem] = []
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        last = number == len(lines)
        if last and not raw:
            break  # the file ends with a newline, as a whole last line does
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            reason = "truncated line (no newline: the writer died mid-line?)" if last else f"not JSON ({err})"
            problems.append(Problem(path, number, reason))
            continue
        try:
            events.append(from_json(obj))
        except (ValueError, TypeError) as err:
            problems.append(Problem(path, number, str(err)))
    return events, problems


def read_events(directory: str) -> tuple[list[Event], list[Problem]]:
    """Every event of the directory's files (``events-*.jsonl``) in time order, and every line skipped.

    A missing directory has no events and no problem.
    """
    events: list[Event] = []
    problems: list[Problem] = []
    for path in sorted(glob.glob(os.path.join(directory, FILE_GLOB))):
        found, bad = read_file(path)
        events += found
        problems += bad
    events.sort(key=lambda e: e.time)  # stable: one writer's events keep their order
    return events, problems


def signal_name(number: int) -> str:
    """The name of an event's ``signal`` (``SIGKILL``), or ``signal N`` for a number no signal has here."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
