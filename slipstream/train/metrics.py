"""Training metrics records: one flat dict per step, written where people and tools read them.

Every record has a `kind`: "run" (at every start: sizes, FLOPs per token, the MFU peak and its
source), "train" (every optimizer step), "eval" (held-out loss), "checkpoint" (a committed save),
and the resilience records "resume", "config_change", "rollback", "skip" and "preempted". Rank 0
appends each as a JSON line to `metrics.jsonl` in the run directory, hands train and eval
records to TensorBoard when it is installed, and prints a concise line every `interval` steps.

MFU follows PaLM appendix B and torchtitan: model FLOPs per token are
`perf.flops.train_flops_per_token(config, seq_len)` = 6N + 12·L·H·Q·T (no causal halving, no
recomputation counted; N the matmul weights a token uses, so a mixture-of-experts model's active
experts, `perf.flops.matmul_params`), divided by the per-device peak for the dtype the matmuls run in: the
best measured GEMM path on a CPU (`perf.hardware.calibrate`), the datasheet on a GPU.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipstream.perf.records import METRICS_FILE

logger = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA's max allocated bytes on a GPU, the process's peak resident set
    (ru_maxrss) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def resolve_peak_flops(device: torch.device, dtype: str, override: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one device for `dtype`, where the number comes from)."""
    if override is not None:
        return override, "logging.peak_flops_per_s"
    from slipstream.perf.hardware import calibrate, get_accelerator

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            return get_accelerator(name).peak_flops(dtype), f"datasheet {name} {dtype}"
        except ValueError:
            logger.info("%s is not in the accelerator table; calibrating", name)
    calibration = calibrate(device=device.type)
    key = "fp32" if dtype == "float32" else "bf16"
    path = calibration.best_paths.get(key, "?")
    return calibration.peak_flops(dtype), (
        f"calibrated {calibration.device_name}, {calibration.num_threads} threads, {key} {path}"
    )


class MetricsLogger:
    """Writes records on rank 0 (other ranks' loggers do nothing)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        console: Callable[[str], None] | None = None,
        console_interval: int = 10,
        tensorboard: bool = True,
    ) -> None:
        self.enabled = enabled
        self.console = console
        self.console_interval = console_interval
        self._file = open(run_dir / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        self._tensorboard = _tensorboard_writer(run_dir) if enabled and tensorboard else None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None and record["kind"] in ("train", "eval"):
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "kind"):
                    self._tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
        line = format_record(record)
        show = record["kind"] != "train" or record["step"] % self.console_interval == 0
        if line and show:
            (self.console or logger.info)(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def format_record(record: dict[str, Any]) -> str:
    """One concise console line per record."""
    kind = record["kind"]
    if kind == "train":
        return (
            f"step {record['step']:>6}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}"
            f"  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s"
            f"  mfu {100 * record['mfu']:.1f}%  step {record['step_s']:.2f}s"
            f" (data {record['data_wait_s']:.3f}s)  mem {record['peak_memory_bytes'] / 2**30:.2f}GiB"
            + _routing_text(record)
        )
    if kind == "eval":
        return (f"eval   {record['step']:>6}  loss {record['eval_loss']:.4f}  "
                f"perplexity {record['eval_perplexity']:.2f}  ({record['eval_s']:.1f}s)")
    if kind == "checkpoint":
        return (f"saved checkpoint at step {record['step']} to {record['path']} (the step waited "
                f"{1e3 * record['checkpoint_s']:.0f} ms, written in {record['write_s']:.1f}s)")
    if kind == "profile":
        return (f"profiler trace of step {record['step']} written to {record['path']} "
                f"({record['trace_s']:.2f}s)")
    if kind == "resume":
        skipped = f"; skipped invalid: {'; '.join(record['skipped'])}" if record["skipped"] else ""
        resharded = " (resharded to this layout)" if record["resharded"] else ""
        return (f"resumed from {record['path']} at step {record['step']}{resharded} in "
                f"{record['restore_s']:.1f}s{skipped}")
    if kind == "config_change":
        return f"resuming with a changed config: {record['change']}"
    if kind == "rollback":
        return (f"non-finite loss ({record['loss']}) at step {record['step']}: rolled back to step "
                f"{record['to_step']}, skipping its batches")
    if kind == "skip":
        return (f"skipping the batches at epoch {record['data_epoch']}, position "
                f"{record['data_position']} (step {record['step']})")
    if kind == "preempted":
        return f"SIGTERM: saved the checkpoint of step {record['step']}; rerun the command to resume"
    if kind == "run":
        return (
            f"training {record['num_params'] / 1e6:.1f}M parameters on {record['world_size']} "
            f"rank(s), {record['device']}, {record['dtype']}; {record['tokens_per_step']:,} tokens "
            f"per step; MFU against {record['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s "
            f"({record['peak_source']})"
        )
    return ""


def _routing_text(record: dict[str, Any]) -> str:
    """A mixture-of-experts step's load-balancing loss and expert load, or nothing."""
    if "load_balancing_loss" not in record:
        return ""
    return (f"  lb_loss {record['load_balancing_loss']:.4f}  expert load max/mean "
            f"{record['expert_load_max_over_mean']:.2f}  idle experts {record['idle_experts']}")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _tensorboard_writer(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))
