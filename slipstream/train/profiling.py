"""Profiler traces of training steps, on torchtitan's schedule and in its layout.

With `profiling.enable_profiling`, every rank runs `torch.profiler.profile` over the training
loop (CPU activity, and CUDA when the run trains on CUDA; shapes recorded) with
`torch.profiler.schedule(wait=profile_freq - (warmup + active), warmup, active)`: of every
`profile_freq` steps it idles through the first, warms up for `profiler_warmup` (the profiler
runs, its events are discarded) and records the last `profiler_active`, then writes them as a
Chrome trace (Kineto JSON) to

    RUN_DIR/<save_traces_folder>/iteration_<N>/rank<R>_trace.json

N being the step the trace ends at: profile_freq, 2 x profile_freq, ... The schedule runs on the
trainer's step numbers, so a resumed run keeps the uninterrupted one's schedule and folders, and
the steps redone after a rollback keep their numbers. A window the restart cuts is written in two
parts: the part before the restart ends at the last step done (as any run that stops while the
profiler records), the part after it, without its warm-up, at the window's own step.

A trace is exported to `rank<R>_trace.json.tmp` and renamed into place once complete, so a kill
while it is written never leaves a truncated trace (`slipstream perf trace` reads only *.json
and *.json.gz). A trace that cannot be written (a full disk, a path taken by a file) is logged
as an error and skipped: profiling must never take the training run down.

The profiler's step marks are the trainer's steps: the `ProfilerStep#N` annotation runs from the
moment step N begins (after the check for a preemption) until step N + 1 begins, so it holds the
step's evaluation, checkpoint save and hooks too, as torchtitan's does. torchtitan numbers its
marks from 0 (its `ProfilerStep#N` is its step N + 1); here #N is the step of `metrics.jsonl`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.perf.kineto import export_trace
from slipstream.train.config import ProfilingConfig

logger = logging.getLogger(__name__)

TRACE_FOLDER = "iteration_{step}"
TRACE_FILE = "rank{rank}_trace.json"


@dataclasses.dataclass(frozen=True)
class WrittenTrace:
    """A trace this rank wrote: the step it ends at, its file, and the seconds its writing took
    (stopping the profiler, gathering its events, exporting them)."""

    step: int
    path: Path
    seconds: float


def trace_path(traces_dir: Path, step: int, rank: int) -> Path:
    """Where rank `rank` writes the trace that ends at step `step`."""
    return traces_dir / TRACE_FOLDER.format(step=step) / TRACE_FILE.format(rank=rank)


class StepProfiler:
    """One rank's profiler over the training loop; does nothing unless profiling is enabled.

    `start(steps_done)` before the loop, `step(steps_done)` before every step, `stop()` after the
    loop (it writes the trace of steps it was recording when the loop ended early). `step` and
    `stop` return the trace they wrote, if any."""

    def __init__(self, config: ProfilingConfig, run_dir: Path, *, rank: int, device_type: str) -> None:
        self.config = config
        self.traces_dir = Path(run_dir) / config.save_traces_folder
        self.rank = rank
        self._device_type = device_type
        self._profile: torch.profiler.profile | None = None
        self._ending_step = 0
        self._saved: Path | None = None

    def start(self, steps_done: int) -> None:
        """Start profiling before step `steps_done + 1` (0 for a new run, the checkpoint's step
        for a resumed one)."""
        if not self.config.enable_profiling:
            return
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities, schedule=self._schedule(), on_trace_ready=self._save, record_shapes=True,
            profile_memory=self.config.profile_memory,
        )
        # The profile starts idle at the last step done (marked, empty); `step` moves it to the next.
        self._profile.step_num = steps_done
        self._profile.__enter__()

    def step(self, steps_done: int) -> WrittenTrace | None:
        """Step `steps_done + 1` begins: mark it and take the schedule's action for it (warm up,
        record, or save the trace that ended with the step before)."""
        if self._profile is None:
            return None
        profile = self._profile
        ending_step = profile.step_num  # the step that began last: steps_done, or before a rollback its step
        profile.step_num = steps_done  # after a rollback, the steps redone keep their numbers
        return self._timed(profile.step, ending_step=ending_step)

    def stop(self) -> WrittenTrace | None:
        """Stop profiling; a trace it was recording ends at the step that began last."""
        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        return self._timed(lambda: profile.__exit__(None, None, None), ending_step=profile.step_num)

    def _schedule(self) -> Callable[[int], torch.profiler.ProfilerAction]:
        """torchtitan's schedule over step numbers. torchtitan counts its profiler steps from 0,
        one below its training steps; skipping step 0 here (where the profile is built, before
        any step) gives step N the action of torchtitan's profiler step N - 1, so the same steps
        are traced and each trace ends at a multiple of profile_freq."""
        config = self.config
        return torch.profiler.schedule(
            wait=config.profile_freq - (config.profiler_warmup + config.profiler_active),
            warmup=config.profiler_warmup, active=config.profiler_active, skip_first=1,
        )

    def _timed(self, call: Callable[[], None], *, ending_step: int) -> WrittenTrace | None:
        """Run a profiler call; the trace it wrote (through `_save`), if any, with its seconds."""
        self._ending_step, self._saved = ending_step, None
        start = time.perf_counter()
        call()
        if self._saved is None:
            return None
        return WrittenTrace(step=ending_step, path=self._saved, seconds=time.perf_counter() - start)

    def _save(self, profile: torch.profiler.profile) -> None:
        """torch's `on_trace_ready`: write the trace whole or not at all (`export_trace`). It must
        not raise: torch runs it in the middle of a profiler transition, and one cut short leaves
        the profiler in a state where stopping it crashes the process; so a write that fails is
        logged and the trace dropped."""
        path = trace_path(self.traces_dir, self._ending_step, self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            export_trace(profile, path)
        except Exception as e:
            logger.error("profiler trace %s not written: %s", path, e)
            return
        self._saved = path
