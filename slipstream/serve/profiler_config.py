"""vLLM's `profiler_config` for the engine (its fields, defaults and checks), and the checks of
`start_profile`'s arguments; the profiler that follows it is profiler.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from torch.profiler import ProfilerActivity

from slipstream.serve.json_config import config_fields

ACTIVITIES = {"CPU": ProfilerActivity.CPU, "CUDA": ProfilerActivity.CUDA}
_UNSUPPORTED_KINDS = {
    "cuda": "the 'cuda' profiler (cudaProfilerStart/Stop for nsys)",
    "proton": "the 'proton' profiler (Triton's)",
}
_UNSUPPORTED_FLAGS = {
    "capture_torch_profiler": "slipstream does not profile its CUDA-graph capture",
    "detailed_trace_annotation": "slipstream's step annotations carry no roofline metrics",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfilerConfig:
    """vLLM's `profiler_config`, for its "torch" profiler; field names and defaults are vLLM's."""

    profiler: str | None = None
    """"torch" to profile with torch.profiler; None: profiling is off (start_profile is an error)."""
    torch_profiler_dir: str = ""
    """Where traces go (created when the first trace is written): a relative path is made absolute
    against the working directory, as vLLM makes it."""
    torch_profiler_activities: tuple[str, ...] | None = None
    """"CPU" and/or "CUDA"; default: CPU, and CUDA too on a CUDA engine."""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    """With CUDA activity: `<worker>.profiler_out.txt` holds the operators' table by self device
    time (vLLM's); off, a session with CUDA activity writes no table. A CPU-only session always
    writes its table, by self CPU time."""
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    ignore_frontend: bool = False
    """vLLM's switch for its front-end process's own CPU trace; slipstream has no separate front
    end (its one trace holds the server's thread and the engine's), so either value means that."""
    capture_torch_profiler: bool = False
    """vLLM's profile of CUDA-graph capture; slipstream does not profile the capture, so only False."""
    detailed_trace_annotation: bool = False
    """vLLM's roofline-metric step annotations; slipstream's steps carry no such metrics, so only False."""
    delay_iterations: int = 0
    """Engine steps after start_profile that are not recorded."""
    max_iterations: int = 0
    """Most engine steps recorded (after the delay, and, with a schedule, active steps only); 0: no
    limit. The trace is written as soon as the last one ends."""
    wait_iterations: int = 0
    """With warmup_iterations, torch.profiler's schedule (repeat 1): steps not profiled, then
    warmup steps profiled and discarded, then active_iterations recorded steps; the trace is
    written after them. Both 0: every step is recorded, and active_iterations is unused."""
    warmup_iterations: int = 0
    active_iterations: int = 5

    def __post_init__(self) -> None:
        if self.profiler in _UNSUPPORTED_KINDS:
            raise ValueError(f"profiler {self.profiler!r} is not supported: slipstream does not have "
                             f"{_UNSUPPORTED_KINDS[self.profiler]}; use 'torch'")
        if self.profiler not in (None, "torch"):
            raise ValueError(f"profiler must be 'torch' or None, got {self.profiler!r}")
        for name in ("delay_iterations", "max_iterations", "wait_iterations", "warmup_iterations"):
            _check_count(name, getattr(self, name), minimum=0)
        _check_count("active_iterations", self.active_iterations, minimum=1)
        for name in ("torch_profiler_with_stack", "torch_profiler_with_flops", "torch_profiler_use_gzip",
                     "torch_profiler_dump_cuda_time_total", "torch_profiler_record_shapes",
                     "torch_profiler_with_memory", "ignore_frontend", "capture_torch_profiler",
                     "detailed_trace_annotation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"profiler_config {name} must be True or False, got {getattr(self, name)!r}")
        for name, unsupported in _UNSUPPORTED_FLAGS.items():
            if getattr(self, name):
                raise ValueError(f"profiler_config {name}=True is not supported: {unsupported}")
        self._check_activities()
        self._check_dir()

    def _check_activities(self) -> None:
        activities = self.torch_profiler_activities
        if activities is None:
            return
        if isinstance(activities, str) or not isinstance(activities, list | tuple) or not activities:
            raise ValueError(f"profiler_config torch_profiler_activities must be a non-empty list of "
                             f"{sorted(ACTIVITIES)}, got {activities!r}")
        unknown = [a for a in activities if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"profiler_config torch_profiler_activities {unknown} are not supported "
                             f"(supported: {sorted(ACTIVITIES)})")
        if len(set(activities)) != len(activities):
            raise ValueError(f"profiler_config torch_profiler_activities {list(activities)} holds duplicates")
        if self.profiler != "torch":
            raise ValueError("profiler_config torch_profiler_activities needs profiler 'torch'")
        object.__setattr__(self, "torch_profiler_activities", tuple(activities))

    def _check_dir(self) -> None:
        directory = self.torch_profiler_dir
        if not isinstance(directory, str | os.PathLike):
            raise ValueError(f"profiler_config torch_profiler_dir must be a path, got {directory!r}")
        directory = os.path.expanduser(os.fspath(directory))
        if directory and self.profiler != "torch":
            raise ValueError("profiler_config torch_profiler_dir needs profiler 'torch'")
        if self.profiler == "torch" and not directory:
            raise ValueError("profiler_config torch_profiler_dir must be set when profiler is 'torch'")
        # vLLM's docs ask for an absolute path; its config makes a relative one absolute.
        object.__setattr__(self, "torch_profiler_dir", os.path.abspath(directory) if directory else directory)

    @property
    def uses_schedule(self) -> bool:
        """Whether steps follow torch.profiler's wait/warmup/active schedule (as vLLM: when
        wait_iterations or warmup_iterations is set)."""
        return self.wait_iterations > 0 or self.warmup_iterations > 0

    @classmethod
    def parse(cls, value: ProfilerConfig | Mapping[str, Any] | str) -> ProfilerConfig:
        """From a ProfilerConfig, a dict or its JSON text (vLLM's --profiler-config); unknown
        fields are a ValueError naming them."""
        if isinstance(value, ProfilerConfig):
            return value
        return cls(**config_fields(value, cls, "profiler_config"))


def check_profile_request(profile_prefix: Any, delay_iterations: Any, max_iterations: Any) -> None:
    """ValueError naming a bad start_profile argument: a prefix of 1-128 ASCII letters, digits, '.',
    '_' or '-' that starts with a letter or digit (it names a file), counts >= 0 (as vLLM's)."""
    if profile_prefix is not None:
        valid = (isinstance(profile_prefix, str) and 1 <= len(profile_prefix) <= 128
                 and profile_prefix.isascii() and profile_prefix[0].isalnum()
                 and all(c.isalnum() or c in "._-" for c in profile_prefix))
        if not valid:
            raise ValueError(f"profile_prefix must be 1-128 ASCII letters, digits, '.', '_' or '-', "
                             f"starting with a letter or digit; got {profile_prefix!r}")
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is not None:
            _check_count(name, value, minimum=0)


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
