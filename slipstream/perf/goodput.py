"""The goodput ledger: every second of a run's wall time, across restarts, charged to productive
training or to a named loss.

The trainer's rank 0 appends one JSON line per event to RUN_DIR/goodput.jsonl and flushes it, so
the log survives a kill at any point (`slipstream.train.goodput` writes it). This module reads it,
as perf reads the other metrics records: `summarize(read_events(run_dir))` charges the time:

| bucket | what |
|---|---|
| `productive` | compute time of the steps whose results survive into the run's state |
| `data_stall` | time those steps waited for a batch |
| `startup` | from a process's start (or the launcher's) until it is ready to train, less the restore |
| `restore` | loading a checkpoint: when an attempt starts, and rolling back after a non-finite loss |
| `checkpoint_stall` | the part of each save the step waited for (the previous save, staging) |
| `eval` | held-out evaluations |
| `profiling` | writing profiler traces (`[profiling]`; the profiled steps' own slowdown is in their steps) |
| `lost_work` | steps lost to a crash, hang or rollback and redone; if unfinished, after the last commit |
| `restart` | from the last event of an unfinished attempt to the next process's start, and the backoff |
| `other` | the rest inside attempts: logging, hooks, shutdown |

An attempt preempted while it was starting (a `start`, then an `end`, no `ready`) is start-up
from its process's start to its end.

goodput = productive / total, total = from the first start to the latest event of an attempt
(a launch after the last attempt's start is not one), less the time between jobs: from an
attempt that finished to the next launch (a finished run started again to train further), which
is no attempt's time, so neither a restart nor part of the total. A ledger line that is cut
short or not a well-formed event is skipped and counted. This is the
Google ML Goodput and Meta ETTR definition: productive, preserved step time over the job's
wall time across all attempts (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

LEDGER_FILE = "goodput.jsonl"
BUCKETS = ("productive", "data_stall", "startup", "restore", "checkpoint_stall", "eval", "profiling",
           "lost_work", "restart", "other")


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger's well-formed events in file order (see `read_ledger`)."""
    return read_ledger(run_dir)[0]


def read_ledger(run_dir: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The ledger's well-formed events in file order, and how many lines were skipped: a line cut
    short by a kill, or one that is not an event `summarize` can charge (see `well_formed`)."""
    path = Path(run_dir) / LEDGER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {LEDGER_FILE}; is it a training run directory?")
    events, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if well_formed(event):
            events.append(event)
        else:
            skipped += 1
    return events, skipped


# The seconds each kind of event carries, besides its time `t`.
_DURATIONS = {
    "start": ("process_start",),
    "ready": ("process_start", "restore_s", "backoff_s"),
    "step": ("step_s", "data_s"),
    "rollback": ("restore_s",),
    "checkpoint": ("stall_s",),
    "eval": ("eval_s",),
    "profile": ("trace_s",),
}


def well_formed(event: Any) -> bool:
    """Whether `event` holds what `summarize` reads: an `event` name, a finite time `t`, its kind's
    seconds (finite; durations >= 0), an integer `step` in steps and commits, an end's `reason`."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    kind = event["event"]
    for key in ("t", *_DURATIONS.get(kind, ())):
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        if key.endswith("_s") and value < 0:
            return False
    if kind in ("step", "commit") and (isinstance(event.get("step"), bool)
                                       or not isinstance(event.get("step"), int)):
        return False
    return kind != "end" or isinstance(event.get("reason"), str)


def summarize(events: list[Any], *, skipped_lines: int = 0) -> dict[str, Any]:
    """Seconds per bucket (they sum to `total_s`), goodput, and counts of attempts, restarts,
    lost and kept steps. Events that are not `well_formed` are left out and counted with
    `skipped_lines` (lines `read_ledger` skipped) in `skipped_lines`.

    The order of attempts and of a step's executions is the file's (one writer appends); times
    only measure: the total runs from the earliest start to the latest event, less the time
    between jobs (`between_jobs_s`: from a finished attempt to the next launch), so a clock that
    steps back does not make it negative. Where the charged durations add up to more than that
    span (a wall clock stepped back under them, or a ledger whose events overlap), the total is
    what was charged, `other` is 0 and `overcharged_s` says by how much the span fell short."""
    valid = [e for e in events if well_formed(e)]
    skipped_lines += len(events) - len(valid)
    start_indices = [i for i, e in enumerate(valid) if e["event"] == "start"]
    if not start_indices:
        raise ValueError("the goodput ledger has no start event")
    # A launch after the last start launched nothing that ran (a relaunch that failed to start,
    # or one starting now): it neither begins nor ends the run's wall time.
    events = [e for i, e in enumerate(valid) if e["event"] != "launch" or i < start_indices[-1]]
    starts = [e for e in events if e["event"] == "start"]
    launches = [e["t"] for e in events if e["event"] == "launch"]
    origin = min([*launches, *(e["process_start"] for e in starts)])
    gaps = _gaps(events)
    total_s = max(max(e["t"] for e in events if e["event"] != "launch") - origin - gaps.between_jobs, 0.0)
    finished = _finished(events)
    kept, lost = _classify_steps(events, finished)
    seconds = _charge(events, origin, bool(launches), kept, lost, gaps)
    charged = sum(seconds.values())
    overcharged_s = max(charged - total_s, 0.0)
    total_s += overcharged_s
    seconds["other"] = total_s - charged
    return {
        "goodput": seconds["productive"] / total_s if total_s > 0 else 0.0,
        "total_s": total_s,
        "seconds": seconds,
        "attempts": len(starts),
        "restarts": gaps.restarts,
        "between_jobs_s": gaps.between_jobs,
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "steps_kept": len(kept),
        "steps_lost": len(lost),
        "last_step": max((e["step"] for e in kept), default=0),
        "finished": finished,
        "skipped_lines": skipped_lines,
        "overcharged_s": overcharged_s,
    }


def _charge(events: list[dict[str, Any]], origin: float, launched: bool, kept: list[dict],
            lost: list[dict], gaps: _Gaps) -> dict[str, float]:
    """Seconds per bucket, `other` (the remainder of the total) left at 0."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    seconds["restart"] = gaps.restart
    first_start = next(e for e in events if e["event"] == "start")
    seconds["startup"] = (first_start["process_start"] - origin if launched else 0.0) + gaps.relaunch_startup
    starting = None  # the start of an attempt that is not ready yet
    for e in events:
        kind = e["event"]
        if kind == "start":
            starting = e
        elif kind == "end" and starting is not None:  # preempted while starting: all start-up
            seconds["startup"] += max(e["t"] - starting["process_start"], 0.0)
            starting = None
        elif kind == "ready":
            starting = None
            seconds["startup"] += max(e["t"] - e["process_start"] - e["restore_s"] - e["backoff_s"], 0.0)
            seconds["restore"] += e["restore_s"]
            seconds["restart"] += e["backoff_s"]
        elif kind == "rollback":
            seconds["restore"] += e["restore_s"]
        elif kind == "checkpoint":
            seconds["checkpoint_stall"] += e["stall_s"]
        elif kind == "eval":
            seconds["eval"] += e["eval_s"]
        elif kind == "profile":
            seconds["profiling"] += e["trace_s"]
    seconds["productive"] = sum(max(e["step_s"] - e["data_s"], 0.0) for e in kept)
    seconds["data_stall"] = sum(min(e["data_s"], e["step_s"]) for e in kept)
    seconds["lost_work"] = sum(e["step_s"] for e in lost)
    return seconds


def _finished(events: list[dict[str, Any]]) -> bool:
    """Whether the last attempt's last `end` says it finished (whatever was appended after it)."""
    last_start = max(i for i, e in enumerate(events) if e["event"] == "start")
    ends = [e for e in events[last_start:] if e["event"] == "end"]
    return bool(ends) and ends[-1]["reason"] == "finished"


@dataclasses.dataclass
class _Gaps:
    """The time between attempts."""

    restart: float = 0.0
    """From an attempt's last event to the next attempt's process start (it had not finished)."""
    restarts: int = 0
    between_jobs: float = 0.0
    """From an attempt that finished to the next launch (or process start, without one)."""
    relaunch_startup: float = 0.0
    """From such a launch to its attempt's process start."""


def _gaps(events: list[dict[str, Any]]) -> _Gaps:
    gaps = _Gaps()
    last_t, finished_t, launch_t = None, None, None
    for e in events:
        kind = e["event"]
        if kind == "launch":
            launch_t = e["t"]
            continue
        if kind == "start" and finished_t is not None:
            resumed = launch_t if launch_t is not None and launch_t >= finished_t else e["process_start"]
            gaps.between_jobs += max(resumed - finished_t, 0.0)
            gaps.relaunch_startup += max(e["process_start"] - resumed, 0.0)
        elif kind == "start" and last_t is not None:
            gaps.restart += max(e["process_start"] - last_t, 0.0)
            gaps.restarts += 1
        if kind == "start":
            finished_t = None
        elif kind == "end":
            finished_t = e["t"] if e["reason"] == "finished" else None
        last_t = e["t"]
    return gaps


def _classify_steps(events: list[dict[str, Any]], finished: bool) -> tuple[list[dict], list[dict]]:
    """(kept, lost) step events: a step is kept when it is the last execution of its step
    number, and, unless the run finished, no later than the newest committed checkpoint."""
    steps = [e for e in events if e["event"] == "step"]
    last_index = {e["step"]: i for i, e in enumerate(steps)}
    committed = max((e["step"] for e in events if e["event"] == "commit"), default=0)
    kept, lost = [], []
    for i, e in enumerate(steps):
        survives = last_index[e["step"]] == i and (finished or e["step"] <= committed)
        (kept if survives else lost).append(e)
    return kept, lost


def format_summary(summary: dict[str, Any]) -> str:
    """The breakdown as a table, largest loss first."""
    total = summary["total_s"]
    skipped = summary.get("skipped_lines", 0)
    lines = [
        f"goodput {100 * summary['goodput']:.1f}% of {total:.1f}s wall time over "
        f"{summary['attempts']} attempt(s) ({summary['restarts']} restart(s), "
        f"{summary['rollbacks']} rollback(s)); {summary['steps_kept']} steps kept, "
        f"{summary['steps_lost']} lost and recomputed"
        + ("" if summary["finished"] else "; the run has not finished")
        + (f"; {summary['between_jobs_s']:.1f}s between jobs (after a finished one) left out"
           if summary.get("between_jobs_s") else "")
        + (f"; {skipped} malformed ledger line(s) skipped" if skipped else ""),
    ]
    seconds = summary["seconds"]
    order = ["productive"] + sorted((b for b in BUCKETS if b != "productive"), key=lambda b: -seconds[b])
    for bucket in order:
        share = 100 * seconds[bucket] / total if total > 0 else 0.0
        lines.append(f"  {bucket:<17} {seconds[bucket]:>10.2f}s {share:>6.1f}%")
    overcharged = summary.get("overcharged_s", 0.0)
    if overcharged > 0.01 * total:
        lines.append(f"  the events' durations exceed the span of their times by {overcharged:.2f}s (a "
                     "wall clock that stepped back, or overlapping events): the total counts the durations")
    return "\n".join(lines)
