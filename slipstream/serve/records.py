"""The serving engine's metrics records: JSON lines in `<metrics_dir>/metrics.jsonl`.

With `EngineConfig.metrics_dir` set, the engine appends one flat JSON object per line (DESIGN.md,
"Metrics records"; every field with its unit in docs/engine.md, "Metrics records"):

- `kind: "engine_config"`, once when the engine starts: the model, the engine's limits, and the
  hardware peaks that MFU and bandwidth use are taken against (`hardware_peaks`);
- `kind: "engine_step"`, for every `Engine.step()` that ran the model: the tokens it computed by
  kind, its shape as `slipstream.perf.records` reads it (`phase`, `batch_size`, `prompt_len` or
  `context_len`, `step_s`), the load after it, and its FLOPs and bytes read
  (`slipstream.perf.flops`) against the peaks;
- `kind: "request"`, for every completion that ended (stop, length, abort or error), with vLLM's
  per-request intervals: the values the server's Prometheus histograms observe
  (`request_intervals`).

Names are vLLM's metric names without the `vllm:` prefix where it has one; every record carries
the `engine_id` of the engine that wrote it, as several engines may append to one file. Each
record is one unbuffered `write` of one line, so a killed process leaves whole lines but perhaps
the last, which the reader skips (and the next engine to open the file ends that line first).
Records never stop the engine: the first write that fails (a full disk, an I/O error) is one
warning, and the engine goes on without records.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slipstream.model.weights import dtype_name
from slipstream.perf import flops, hardware
from slipstream.perf.records import METRICS_FILE
from slipstream.serve.request import RequestMetrics
from slipstream.serve.scheduler import StepPlan

if TYPE_CHECKING:  # the engine builds its records; importing it here would be circular
    from slipstream.model.config import ModelConfig
    from slipstream.perf.accelerators import Accelerator
    from slipstream.serve.engine import Engine
    from slipstream.serve.outputs import PromptOutput, SequenceOutput
    from slipstream.serve.pooling import PoolingJob

logger = logging.getLogger(__name__)

_ENCODER = json.JSONEncoder(allow_nan=False)
"""Plain JSON (a NaN or infinity is a bug, not a record); one encoder, as `json.dumps` with options
builds one per call, which doubled the cost of a step's record."""

FLOPS_CONVENTION = ("perf.flops.forward_flops: 2N per token through the layers (N the matmul weights a "
                    "token uses, lm_head apart), the lm_head only where logits are taken, causal "
                    "attention 4*L*H*Q per key attended; over the peak for the model's dtype")


def request_intervals(metrics: RequestMetrics, finished_s: float, num_output_tokens: int) -> dict[str, Any]:
    """vLLM's per-request intervals, in seconds under vLLM's names, of a completion of
    `num_output_tokens` tokens that ended at `finished_s` (the engine's monotonic clock); None for
    an interval the completion never completed: queue time before it was scheduled, the others
    but end-to-end before its first token (aborted), a time per output token below two tokens.
    The server's histograms and the request records both take them from here."""
    scheduled_s, first_token_s = metrics.first_scheduled_time_s, metrics.first_token_time_s
    if first_token_s is None:
        decode_s = prefill_s = inference_s = None
    else:
        decode_s = finished_s - first_token_s
        prefill_s = None if scheduled_s is None else first_token_s - scheduled_s
        inference_s = None if scheduled_s is None else finished_s - scheduled_s
    return {
        "e2e_request_latency_seconds": finished_s - metrics.arrival_time_s,
        "request_queue_time_seconds": metrics.queue_time_s,
        "time_to_first_token_seconds": metrics.time_to_first_token_s,
        "request_prefill_time_seconds": prefill_s,
        "request_decode_time_seconds": decode_s,
        "request_inference_time_seconds": inference_s,
        "request_time_per_output_token_seconds": (None if decode_s is None or num_output_tokens < 2
                                                  else decode_s / (num_output_tokens - 1)),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Peaks:
    """What MFU and bandwidth use are taken against, and where the numbers come from."""

    hardware: str | None
    flops_per_s: float | None
    read_bytes_per_s: float | None
    source: str


def _peak_multiples(tensor_parallel_size: int, device: torch.device) -> tuple[int, int]:
    """How many times one rank's peak FLOPs and read bandwidth a tensor-parallel step has: on GPUs
    each rank is a device of its own; a CPU's ranks, each at its share of the threads (the
    calibration's thread count), add up their cores' FLOPs (as many as the cores hold) but share
    one memory system, whose read bandwidth (at one rank's threads) stands for it."""
    if device.type != "cpu":
        return tensor_parallel_size, tensor_parallel_size
    if tensor_parallel_size == 1:
        return 1, 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(tensor_parallel_size, cpus // torch.get_num_threads())), 1


def hardware_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    """The peaks of `device` for `dtype`: a GPU's datasheet where the accelerator table has it,
    else the device's cached calibration (`perf.hardware.cached_calibration`). Never a new
    calibration, which takes minutes: without a cached one the peaks are None and `source` says
    how to get them."""
    if device.type == "cuda":
        try:
            table = hardware.get_accelerator(torch.cuda.get_device_name(device))
        except ValueError:  # not in the table: a calibration may still be cached
            pass
        else:
            return _peaks(table, dtype, f"datasheet {table.name}")
    calibration = hardware.cached_calibration(device.type)
    if calibration is None:
        return Peaks(None, None, None, f"none: no calibration of this {device.type} at "
                     f"{torch.get_num_threads()} threads is cached; `slipstream perf calibrate` measures "
                     "one (minutes), and engines started after it report MFU and bandwidth use")
    return _peaks(hardware.local_accelerator(calibration), dtype,
                  f"calibrated by slipstream.perf.hardware.calibrate() at {calibration.created_at}")


def _peaks(accelerator: Accelerator, dtype: torch.dtype, source: str) -> Peaks:
    try:
        peak_flops = accelerator.peak_flops(dtype)
    except ValueError as error:  # no matmul path of this dtype: bandwidth use still stands
        peak_flops, source = None, f"{source}; {error}"
    return Peaks(accelerator.name, peak_flops, accelerator.memory_bandwidth_bytes_per_s, source)


@dataclasses.dataclass(slots=True)
class _StepWork:
    """What one engine step computed, counted over its chunks (see `EngineRecords.step`)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0
    decode_positions: int = 0
    """Sum over decode tokens of their position: the context each had cached."""
    num_rows: int = 0
    """Token rows through the layers over all forward passes."""
    num_logits: int = 0
    num_keys: int = 0
    num_kv_positions: int = 0
    prompt_len: int | None = None
    """The length of every chunk, where all start at position 0 and have one length (the prefill
    shape the performance model prices); else None."""


def _step_work(config: ModelConfig, plan: StepPlan, num_passes: int, drafts: Sequence[Sequence[int]] | None,
               takes_logits: bool) -> _StepWork:
    """Count a step's tokens. A chunk of one token that samples is decode-shaped: each of the
    `num_passes` passes computes one new token of it (with a speculative step's guesses after
    it), and that token is a decode unless it is its prompt's last (its prompt computed or
    cached before); every other chunk is a prefill chunk: prompt tokens or, after a preemption,
    outputs recomputed. Decode rows read their own KV positions; a prefill chunk reads the union
    of its queries' windows. Plain decodes, most chunks of a busy step, are counted together."""
    work = _StepWork()
    contexts, lengths = [], set()
    for i, chunk in enumerate(plan.chunks):
        start, num_tokens = chunk.start, chunk.num_tokens
        num_draft = len(drafts[i]) if drafts else 0
        decode_shaped = num_tokens == 1 and chunk.samples
        if decode_shaped and not num_draft and start >= chunk.request.num_prompt_tokens:
            contexts.append(start)
            continue
        rows = num_tokens * num_passes + num_draft
        keys = flops.causal_keys(config, start, rows)
        if decode_shaped:
            prompt_end = int(start < chunk.request.num_prompt_tokens)
            num_decode = num_passes - prompt_end
            work.num_prefill_tokens += prompt_end
            work.num_decode_tokens += num_decode
            work.decode_positions += num_decode * (2 * start + prompt_end + num_passes - 1) // 2
            work.num_kv_positions += keys
            work.num_logits += rows if takes_logits else 0
        else:
            work.num_prefill_tokens += num_tokens
            work.num_kv_positions += flops.kv_positions_read(config, start, num_tokens)
            work.num_logits += int(chunk.samples and takes_logits)
        lengths.add(num_tokens if start == 0 else -1)
        work.num_draft_tokens += num_draft
        work.num_rows += rows
        work.num_keys += keys
    if contexts:  # each a token at every pass, at positions start .. start + num_passes - 1
        keys, num_rows = flops.decode_keys(config, contexts, num_passes), len(contexts) * num_passes
        work.num_decode_tokens += num_rows
        work.decode_positions += num_passes * sum(contexts) + num_rows * (num_passes - 1) // 2
        work.num_kv_positions += keys
        work.num_keys += keys
        work.num_rows += num_rows
        work.num_logits += num_rows if takes_logits else 0
    if len(lengths) == 1 and -1 not in lengths and _phase(work) == "prefill":
        work.prompt_len = lengths.pop()
    return work


def _phase(work: _StepWork) -> str:
    """"prefill" or "decode" where the step computed only that kind of token; "mixed" for prompt
    chunks and decodes together, or decodes with speculative guesses to check."""
    if work.num_draft_tokens or (work.num_prefill_tokens and work.num_decode_tokens):
        return "mixed"
    return "decode" if work.num_decode_tokens else "prefill"


class _RecordFile:
    """The metrics file, appended one whole line per record. A failed write is logged once and ends
    the records (the rest are counted as dropped and the count logged at `close`): a metrics file
    must never fail a request."""

    def __init__(self, path: Path, header: dict[str, Any], metrics_dir: str) -> None:
        """Open `path` and write `header`; ValueError naming `metrics_dir` where either fails (a
        directory in the file's place, no permission, a full disk)."""
        self.path = path
        self._failed = False
        self.num_dropped = 0
        try:
            self._file = open(path, "ab", buffering=0)  # noqa: SIM115  (open for the engine's life)
        except OSError as error:
            raise _unwritable(metrics_dir, path, error) from error
        try:
            torn = _ends_mid_line(self._file)  # a writer killed mid-line: end its line first
            self._write_line(("\n" if torn else "") + _ENCODER.encode(header))
        except (OSError, ValueError) as error:
            self._file.close()
            raise _unwritable(metrics_dir, path, error) from error

    def write(self, record: dict[str, Any]) -> None:
        if self._failed:
            self.num_dropped += 1
            return
        try:
            self._write_line(_ENCODER.encode(record))
        except (OSError, ValueError) as error:  # ValueError: a NaN (a bug) or a file closed under us
            self._fail(error)

    def _write_line(self, text: str) -> None:
        """One `write` of one line (O_APPEND: not interleaved with other engines' lines), repeated
        only where the system wrote part of it."""
        view = memoryview((text + "\n").encode())
        while view:
            num_written = self._file.write(view)
            if not num_written:
                raise OSError(f"wrote none of {len(view)} bytes")
            view = view[num_written:]

    def _fail(self, error: Exception) -> None:
        self._failed = True
        self.num_dropped += 1
        logger.warning("metrics records stop: writing %s failed (%s); the engine goes on without them",
                       self.path, error)
        self._close_file()

    def close(self) -> None:
        """Close the file; log how many records were dropped, if any."""
        self._close_file()
        if self.num_dropped:
            logger.warning("%d metrics records were not written to %s (the first failed write is "
                           "logged above)", self.num_dropped, self.path)

    def _close_file(self) -> None:
        try:
            self._file.close()
        except OSError as error:  # closing an unbuffered file writes nothing, but the system may say no
            logger.warning("closing %s failed: %s", self.path, error)


def _unwritable(metrics_dir: str, path: Path, error: Exception) -> ValueError:
    return ValueError(f"metrics_dir {metrics_dir!r}: cannot append to {path}: {error}")


def _ends_mid_line(file) -> bool:
    """Whether the regular file open as `file` is not empty and does not end in a newline."""
    if not os.path.isfile(file.name) or os.fstat(file.fileno()).st_size == 0:
        return False
    with open(file.name, "rb") as reader:
        reader.seek(-1, os.SEEK_END)
        return reader.read(1) != b"\n"


class EngineRecords:
    """Appends one engine's records to `<metrics_dir>/metrics.jsonl`, starting with its header."""

    def __init__(self, engine: Engine) -> None:
        metrics_dir = os.fspath(engine.config.metrics_dir)
        directory = Path(metrics_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"metrics_dir {metrics_dir!r}: cannot make the directory: {error}") from error
        self.path = directory / METRICS_FILE
        self.engine_id = uuid.uuid4().hex[:12]
        """Tells this engine's records from others' in one file (step numbers and request ids repeat)."""
        self._model_config = engine.model_config
        self._dtype = dtype_name(engine.limits.dtype)
        self._kv_dtype = str(engine.limits.kv_dtype).removeprefix("torch.")
        self._cost = flops.ForwardCost(self._model_config, self._dtype, engine.config.quantization,
                                       kv_dtype=self._kv_dtype)
        self._takes_logits = engine.pooler is None
        self._peaks = hardware_peaks(engine.limits.device, engine.limits.dtype)
        self._devices = engine.config.tensor_parallel_size
        self._compute_devices, self._memory_devices = _peak_multiples(self._devices, engine.limits.device)
        self._wall_minus_monotonic_s = time.time() - time.monotonic()
        self._num_steps = 0
        self._counters = self._totals(engine)
        self._file = _RecordFile(self.path, self._header(engine), metrics_dir)
        weakref.finalize(self, self._file.close)  # the engine has no close: collected, it closes
        if self._peaks.flops_per_s is None and self._peaks.read_bytes_per_s is None:
            logger.warning("metrics records go to %s without MFU and bandwidth use: %s", self.path,
                           self._peaks.source)
        else:
            logger.info("metrics records go to %s (MFU and bandwidth use against: %s)", self.path,
                        self._peaks.source)

    def _header(self, engine: Engine) -> dict[str, Any]:
        config, limits, spec = engine.config, engine.limits, engine.config.speculative_config
        try:
            version = importlib.metadata.version("slipstream")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {
            "kind": "engine_config", "engine_id": self.engine_id, "time": time.time(),
            "model": str(Path(config.model).resolve()),
            "model_type": self._model_config.model_type, "num_params": flops.num_params(self._model_config),
            "dtype": self._dtype, "kv_cache_dtype": self._kv_dtype, "quantization": config.quantization,
            "device": str(limits.device),
            "num_threads": torch.get_num_threads(),
            "runner": "generate" if self._takes_logits else "pooling",
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": limits.max_model_len, "block_size": limits.block_size,
            "num_gpu_blocks": limits.num_blocks,
            "enable_prefix_caching": engine.scheduler.config.enable_prefix_caching,
            "num_scheduler_steps": config.num_scheduler_steps,
            "enforce_eager": config.enforce_eager or self._devices > 1,  # tensor parallelism runs eagerly
            "tensor_parallel_size": self._devices,
            "num_speculative_tokens": None if spec is None else spec.num_speculative_tokens,
            "hardware": self._peaks.hardware, "peak_flops_per_s": self._peaks.flops_per_s,
            "peak_read_bytes_per_s": self._peaks.read_bytes_per_s, "peak_source": self._peaks.source,
            "flops_convention": FLOPS_CONVENTION, "slipstream_version": version,
            "torch_version": torch.__version__,
        }

    @staticmethod
    def _totals(engine: Engine) -> tuple[int, int, int, int]:
        """The engine's running totals that records report per step."""
        kv_cache = engine.scheduler.kv_cache
        return (kv_cache.prefix_cache_queries, kv_cache.prefix_cache_hits, engine.num_draft_tokens,
                engine.num_accepted_tokens)

    def step(self, engine: Engine, plan: StepPlan, num_passes: int, drafts: Sequence[Sequence[int]] | None,
             step_s: float) -> None:
        """Record a step that ran `plan` in `num_passes` forward passes (several: greedy decode
        steps at once), with speculative `drafts` per chunk or None, in `step_s` seconds."""
        work = _step_work(self._model_config, plan, num_passes, drafts, self._takes_logits)
        phase = _phase(work)
        step_flops = self._cost.flops(work.num_rows, work.num_logits, work.num_keys)
        read_bytes = self._cost.bytes_read(work.num_rows // num_passes, work.num_kv_positions,
                                           num_passes=num_passes, reads_lm_head=work.num_logits > 0)
        totals = self._totals(engine)
        queries, hits, drafted, accepted = (now - before for now, before in zip(totals, self._counters,
                                                                                 strict=True))
        self._counters = totals
        self._num_steps += 1
        peaks = self._peaks
        self._file.write({
            "kind": "engine_step", "engine_id": self.engine_id, "step": self._num_steps, "time": time.time(),
            "step_s": step_s, "phase": phase, "batch_size": len(plan.chunks),
            "num_forward_passes": num_passes, "prompt_len": work.prompt_len,
            "context_len": (round(work.decode_positions / work.num_decode_tokens) if phase == "decode"
                            else None),
            "num_prefill_tokens": work.num_prefill_tokens, "num_decode_tokens": work.num_decode_tokens,
            "spec_decode_num_draft_tokens": drafted, "spec_decode_num_accepted_tokens": accepted,
            "num_requests_running": engine.num_running, "num_requests_waiting": engine.num_waiting,
            "num_preemptions": len(plan.preempted_request_ids),
            "kv_cache_usage_perc": engine.scheduler.kv_cache.usage,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "flops": step_flops, "flops_per_s": step_flops / step_s,
            "mfu": (None if peaks.flops_per_s is None
                    else flops.mfu(work.num_rows / step_s, step_flops / work.num_rows,
                                   peaks.flops_per_s * self._compute_devices)),
            "read_bytes": read_bytes, "read_bytes_per_s": read_bytes / step_s,
            "mbu": (None if peaks.read_bytes_per_s is None
                    else flops.mbu(1 / step_s, read_bytes, peaks.read_bytes_per_s * self._memory_devices)),
        })

    def completion(self, entry: PromptOutput, sequence: SequenceOutput, num_preemptions: int,
                   finished_s: float) -> None:
        """Record a completion of a prompt that ended at `finished_s` (the engine's monotonic
        clock), preempted `num_preemptions` times."""
        self._request(entry.request_id, sequence.index, sequence.finish_reason, len(entry.prompt_token_ids),
                      len(sequence.token_ids), entry.num_cached_tokens, num_preemptions, entry.metrics,
                      finished_s)

    def embedding(self, job: PoolingJob, finished_reason: str, num_preemptions: int,
                  finished_s: float) -> None:
        """Record an embedding request that ended (pooled: "stop"; or aborted) at `finished_s`."""
        self._request(job.request_id, 0, finished_reason, len(job.prompt_token_ids), 0, job.num_cached_tokens,
                      num_preemptions, job.metrics, finished_s)

    def _request(self, request_id: str, index: int, finished_reason: str, num_prompt_tokens: int,
                 num_output_tokens: int, num_cached_tokens: int, num_preemptions: int,
                 metrics: RequestMetrics, finished_s: float) -> None:
        self._file.write({
            "kind": "request", "engine_id": self.engine_id, "time": finished_s + self._wall_minus_monotonic_s,
            "request_id": request_id, "index": index, "finished_reason": finished_reason,
            "request_prompt_tokens": num_prompt_tokens,
            "request_generation_tokens": num_output_tokens, "num_cached_tokens": num_cached_tokens,
            "num_preemptions": num_preemptions,
            "arrival_time": metrics.arrival_time_s + self._wall_minus_monotonic_s,
        } | request_intervals(metrics, finished_s, num_output_tokens))
