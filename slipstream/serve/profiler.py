"""vLLM's torch-profiler interface for the engine: `profiler_config`, start_profile and stop_profile.

A profiling session records engine steps with `torch.profiler` and writes one Chrome trace (Kineto
JSON, gzip by default) into `torch_profiler_dir`, named as vLLM's single worker names its trace:
`[PREFIX_]dp0_pp0_tp0_dcp0_ep0_rank0.<time_ns>.pt.trace.json.gz`, and next to it vLLM's
`<worker>.profiler_out.txt` (the `key_averages` table). Every engine step of the session is one
`ProfilerStep#N` annotation; inside it the step's phases are `record_function` ranges named by
`STEP_PHASES`. Without a wait/warmup schedule the mark is a `record_function` opened and closed
around the step, so it covers the step exactly (not the idle time until the next one, as torch's
`prof.step()` marks do); with a schedule, torch's own marks are kept.

The profiler starts at the first engine step after `start_profile` (and its delay), and it is
stepped and stopped on the thread that runs the steps: torch's profiler records the thread that
started it, so the server's engine thread applies start and stop as commands (async_engine.py). A
session that took no step writes no trace, nor does one whose thread already records a torch
profile of its own (a user's `torch.profiler.profile`: two profilers on a thread crash torch or
empty the outer one). A trace that cannot be written is logged, never raised, as vLLM's worker
does; a session still open when the engine is garbage-collected or the interpreter exits is
written then, as vLLM's worker shutdown writes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, record_function

from slipstream.perf.kineto import export_trace
from slipstream.serve.profiler_config import ACTIVITIES, ProfilerConfig, check_profile_request

logger = logging.getLogger(__name__)

SCHEDULE_PHASE = "engine: schedule"
"""The scheduler's plan of the step (admission, token budget, KV blocks, preemption)."""
PREPARE_INPUTS_PHASE = "runner: prepare_inputs"
"""The plan laid out as the flat batch tensors of the forward pass."""
FORWARD_PHASE = "runner: forward"
"""The model's forward pass and its logits (a replayed decode graph included; with
num_scheduler_steps, every decode step of a burst)."""
SAMPLE_PHASE = "engine: sample"
"""The sampler: penalties, masks, temperature, top-k/top-p, the draw, logprobs."""
PROCESS_OUTPUTS_PHASE = "engine: process_outputs"
"""The scheduler's record of the new tokens, stop checks, detokenization, stop strings, outputs."""
STEP_PHASES = (SCHEDULE_PHASE, PREPARE_INPUTS_PHASE, FORWARD_PHASE, SAMPLE_PHASE, PROCESS_OUTPUTS_PHASE)
"""The `record_function` names inside a `ProfilerStep#N`, in the order a step runs them. A step
has each at most once. Every step that runs the sampler has all five, a greedy one included (the
sampler then takes the argmax); a step that takes the argmax in the runner instead (a multi-step
greedy burst, a speculative check) and a pooling step have no sample phase, and a step with
nothing scheduled has only the schedule phase."""

WORKER_NAME = "dp0_pp0_tp0_dcp0_ep0_rank0"
"""vLLM's name for the trace of its one worker (data, pipeline, tensor, context and expert
parallel rank 0): slipstream's single process writes its trace under the same name."""

_NO_PHASE = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """`record_function(name)` while this thread records a torch profile, else a shared no-op: an
    idle `record_function` still costs about 5 us of dispatch, the check about 0.1 us. A user's own
    `torch.profiler.profile` around the engine (without a profiling session, which then records
    nothing) sees the phases too."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_PHASE


class ProfilerAlreadyActiveError(RuntimeError):
    """start_profile while a session is open (vLLM's error of this name; the server's 409)."""

    def __init__(self) -> None:
        super().__init__("a profiling session is already active; call stop_profile before starting another")


@dataclasses.dataclass(slots=True)
class _Session:
    """One start_profile to stop_profile."""

    worker_name: str
    delay_iterations: int
    num_steps: int | None
    """Profiler steps to take before the trace is written (None: until stop_profile)."""
    num_delayed: int = 0
    num_profiled: int = 0
    done: bool = False
    """The trace is written (or the session records nothing); steps until stop_profile are not profiled."""
    profile: torch.profiler.profile | None = None
    """The running torch profiler, from the first step past the delay until the trace is written."""
    thread: int | None = None
    """The thread that started `profile`, the only one that may stop it."""
    step_mark: record_function | None = None
    """The open `ProfilerStep#N` of the running step (without a schedule)."""
    recorded: bool = False
    """Whether a step was recorded (under a schedule, the wait and warm-up steps are not)."""
    trace_path: Path | None = None
    """The trace, once written."""


class EngineProfiler:
    """The engine's profiler: `begin_step` and `end_step` bracket every engine step; sessions
    open with `start` and close with `stop`, as vLLM's worker profiler (delay, limit, schedule). (The
    trainer's is train.profiling.StepProfiler.)"""

    def __init__(self, config: ProfilerConfig, device: torch.device) -> None:
        assert config.profiler == "torch"
        default = ("CPU", "CUDA") if device.type == "cuda" else ("CPU",)
        activities = config.torch_profiler_activities or default
        if "CUDA" in activities and device.type != "cuda":
            raise ValueError(f"profiler_config torch_profiler_activities {list(activities)} name CUDA, but "
                             f"the engine runs on {device.type}")
        self.config = config
        self.activities = [ACTIVITIES[name] for name in activities]
        self._table = _table_spec(config, activities, device)
        self._session: _Session | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def is_active(self) -> bool:
        """Whether a session is open (started and not yet stopped)."""
        return self._session is not None

    def start(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
              max_iterations: int | None = None) -> None:
        """Open a session; the profiler starts at the first engine step past the delay. The trace
        directory is made now, so that one that cannot be is the caller's ValueError, not a failed
        engine step."""
        if self._session is not None:
            raise ProfilerAlreadyActiveError()
        check_profile_request(profile_prefix, delay_iterations, max_iterations)
        config = self.config
        try:
            os.makedirs(config.torch_profiler_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"profiler_config torch_profiler_dir {config.torch_profiler_dir!r} cannot be "
                             f"made: {error.strerror or error}") from error
        delay = config.delay_iterations if delay_iterations is None else delay_iterations
        limit = config.max_iterations if max_iterations is None else max_iterations
        if config.uses_schedule:
            active = min(limit, config.active_iterations) if limit else config.active_iterations
            num_steps = config.wait_iterations + config.warmup_iterations + active
        else:
            num_steps = limit or None
        name = WORKER_NAME if profile_prefix is None else f"{profile_prefix}_{WORKER_NAME}"
        self._session = session = _Session(worker_name=name, delay_iterations=delay, num_steps=num_steps)
        # As vLLM's worker shutdown: a session the program leaves open is written when the engine is
        # collected or the interpreter exits (the finalizer holds the session, not the profiler).
        self._finalizer = weakref.finalize(self, _finish, session, config, self._table)
        logger.info("profiling: the trace goes to %s", config.torch_profiler_dir)

    def stop(self) -> None:
        """Close the session, writing its trace if the profiler still runs (a no-op without one). A
        trace that cannot be written is logged, not raised. RuntimeError on another thread than
        the one that steps the engine, which alone can stop torch's profiler (the session stays)."""
        session = self._session
        if session is None:
            logger.warning("stop_profile without an active profiling session: nothing to stop")
            return
        if session.profile is not None and session.thread != threading.get_ident():
            raise RuntimeError("stop_profile must be called on the thread that steps the engine: torch's "
                               "profiler records that thread and only it can stop the profiler")
        self._session = None
        self._finalizer.detach()
        self._finalizer = None
        _finish(session, self.config, self._table)

    def begin_step(self) -> None:
        """Called as an engine step begins: the profiler's next step (its first starts it)."""
        session = self._session
        if session is None or session.done:
            return
        if session.num_delayed < session.delay_iterations:
            session.num_delayed += 1
            return
        interference = _interference(session)
        if interference:
            _abandon(session, interference)
            return
        if session.profile is None:
            session.profile = self._new_profile(session)
            session.profile.start()
            session.thread = threading.get_ident()
        elif self.config.uses_schedule:
            try:
                session.profile.step()
            except Exception as error:  # a step must not fail for its profile
                _abandon(session, f"the profiler's step failed ({error})")
                return
        if not self.config.uses_schedule:
            session.step_mark = record_function(f"ProfilerStep#{session.num_profiled}")
            session.step_mark.__enter__()
        session.num_profiled += 1
        session.recorded |= session.profile.current_action in (ProfilerAction.RECORD,
                                                               ProfilerAction.RECORD_AND_SAVE)

    def end_step(self) -> None:
        """Called as an engine step ends: close its mark, and write the trace once the session's
        last step is taken."""
        session = self._session
        if session is None:
            return
        if session.step_mark is not None:
            session.step_mark.__exit__(None, None, None)
            session.step_mark = None
        if session.num_profiled == session.num_steps and not session.done:
            session.done = True
            _finish(session, self.config, self._table)

    def _new_profile(self, session: _Session) -> torch.profiler.profile:
        config = self.config
        schedule = None
        if config.uses_schedule:
            schedule = torch.profiler.schedule(wait=config.wait_iterations, warmup=config.warmup_iterations,
                                               active=config.active_iterations, repeat=1)
        return torch.profiler.profile(
            activities=self.activities, schedule=schedule,
            on_trace_ready=functools.partial(_save_trace, session, config),
            record_shapes=config.torch_profiler_record_shapes, with_stack=config.torch_profiler_with_stack,
            profile_memory=config.torch_profiler_with_memory, with_flops=config.torch_profiler_with_flops,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _TableSpec:
    """How vLLM's worker writes `<worker>.profiler_out.txt` (`key_averages().table`)."""

    sort_by: str
    row_limit: int
    group_by_input_shape: bool


def _table_spec(config: ProfilerConfig, activities: tuple[str, ...],
                device: torch.device) -> _TableSpec | None:
    """As vLLM's TorchProfilerWrapper: with a device activity and torch_profiler_dump_cuda_time_total,
    the table by self device time (torch's default 100 rows); CPU activity alone, by self CPU time
    (50 rows); otherwise none. Grouped by input shape on a CPU engine that records shapes."""
    group = device.type == "cpu" and config.torch_profiler_record_shapes
    if any(a != "CPU" for a in activities) and config.torch_profiler_dump_cuda_time_total:
        return _TableSpec("self_device_time_total", 100, group)
    if tuple(activities) == ("CPU",):
        return _TableSpec("self_cpu_time_total", 50, group)
    return None


def _save_trace(session: _Session, config: ProfilerConfig, profile: torch.profiler.profile) -> None:
    """torch's `on_trace_ready`: the trace under the name torch's tensorboard_trace_handler gives it
    (`NAME.<time_ns>.pt.trace.json[.gz]`), written whole or not at all (`export_trace`). It must
    not raise: torch calls it in the middle of a profiler transition, and one cut short leaves
    the profiler in a state where stopping it crashes the process; a failure is logged."""
    suffix = ".pt.trace.json.gz" if config.torch_profiler_use_gzip else ".pt.trace.json"
    path = Path(config.torch_profiler_dir) / f"{session.worker_name}.{time.time_ns()}{suffix}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        export_trace(profile, path)
    except Exception as error:
        logger.warning("profiling: failed to write the trace to %s: %s", config.torch_profiler_dir, error)
        return
    session.trace_path = path


def _finish(session: _Session, config: ProfilerConfig, table: _TableSpec | None) -> None:
    """Stop the session's profiler (its trace handler writes the trace) and write the table; a
    failure is logged with the directory and its cause, never raised, as vLLM's worker does: a
    step's requests, a server's answer or its shutdown must not fail for a trace."""
    if session.step_mark is not None:
        session.step_mark.__exit__(None, None, None)
        session.step_mark = None
    profile, session.profile = session.profile, None
    if profile is None:
        return
    if session.thread != threading.get_ident():
        logger.warning("profiling: the session's trace is not written: the profiler runs on another thread, "
                       "which alone may stop it")
        return
    if _was_ended(profile):
        logger.warning("profiling: the session's trace is not written: another torch profiler started and "
                       "stopped on this thread while the session recorded, which ended its recording")
        return
    directory = config.torch_profiler_dir
    try:
        profile.stop()  # the trace handler writes the file
    except Exception as error:
        cause = error.__cause__ if error.__cause__ is not None else error
        logger.warning("profiling: failed to stop the profiler and write the trace to %s: %s",
                       directory, cause)
        return
    if not session.recorded:  # stopped in the schedule's wait or warm-up steps
        logger.info("profiling: the session ended before a step was recorded: no trace written")
        return
    if session.trace_path is None:  # _save_trace logged why
        return
    logger.info("profiling: trace written to %s", session.trace_path)
    if table is not None:
        _write_table(profile, table, os.path.join(directory, f"{session.worker_name}.profiler_out.txt"))


def _write_table(profile: torch.profiler.profile, table: _TableSpec, path: str) -> None:
    """vLLM's `profiler_out.txt`. torch 2.13's key_averages() fails now and then on a profile
    with Python frames (a UnicodeDecodeError from its own event names); the trace is written by
    then, so the table's failure is logged on its own."""
    try:
        averages = profile.key_averages(group_by_input_shape=table.group_by_input_shape)
        with open(path, "w") as f:
            print(averages.table(sort_by=table.sort_by, row_limit=table.row_limit), file=f)
    except Exception as error:
        logger.warning("profiling: the trace is written, but its key_averages table %s is not: %s",
                       path, error)


def _interference(session: _Session) -> str | None:
    """Why the session must not go on recording this thread, if another torch profiler is on it
    (two on one thread crash torch or empty one of them): None when it may."""
    profile = session.profile
    if profile is None or profile.current_action in (ProfilerAction.NONE, ProfilerAction.WARMUP):
        if torch.autograd._profiler_enabled():  # ours has not started recording: another has
            return ("this thread already records a torch profile (a torch.profiler.profile of the "
                    "caller's own?)")
        return None
    if _was_ended(profile):
        return ("another torch profiler started and stopped on this thread while the session "
                "recorded, which ended its recording")
    return None


def _abandon(session: _Session, why: str) -> None:
    """End the session without a trace, leaving torch's profiler to the other one on this thread.
    Ours is dropped unstopped: stopping it would start its recording first where it waits."""
    session.done, session.profile = True, None
    logger.warning("profiling: %s, so this session records nothing more and writes no trace", why)


def _was_ended(profile: torch.profiler.profile) -> bool:
    """Whether another torch profiler on this thread ended the recording of `profile` (a user's,
    started and stopped between two engine steps): stopping it again would crash torch."""
    recording = profile.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
    return recording and not torch.autograd._profiler_enabled()
