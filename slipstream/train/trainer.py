"""The training loop: one process per rank, the same code for 1 or N ranks.

`Trainer(config)` builds everything from a `TrainConfig`: it joins the process group torchrun
describes, opens the prepared data, builds the model on the meta device, applies the CPU fast
path and `parallelize` (tensor parallelism, activation checkpointing, compile, FSDP2 / DDP over
the data-parallel replicas, whose ranks share their batches, and their context-parallel ranks,
which each keep a slice of every sequence: `train.context_parallel`) or, with pipeline
parallelism, prunes the model to this rank's stages and builds torch's schedule over them
(`train.pipeline`), materializes the weights from rank 0's initial state, and creates AdamW,
the warm-up + decay schedule and the resumable loaders. `run()` then loops: `train_step()`
(micro-batches with gradient accumulation, or through the pipeline schedule; clip, optimizer
step, schedule step) emits one flat metrics record; evaluation and checkpoints happen between
steps, and `hooks` are called after every step with the trainer and its record. A
mixture-of-experts model's loss adds the load-balancing term, and its records the experts' load
(`train.moe`).

Everything a resumed run needs is reachable: `model`, `optimizer`, `lr_scheduler`,
`train_loader` and `train_state()` (step, tokens seen, loader and schedule state, RNG states),
restored by `load_train_state`; `save_checkpoint` / `load_checkpoint` write and read all of it
through the `CheckpointManager` (sharded, asynchronous, atomic). A trainer whose run dir holds
a run resumes it from the newest valid checkpoint, so rerunning a command continues it.

Resilience (docs/training.md, "Failures and restarts"): a non-finite loss rolls back to the
newest checkpoint and skips the step's batches; SIGTERM saves and returns, or, while the
trainer is still being built, stops it before training (`preemption.Preempted`); rank 0 holds
the run dir's workers lock, so a second job there is refused; the hang watchdog, fault injection
(`train.faults`, as hooks), the goodput ledger (`train.goodput`) and the step profiler
(`train.profiling`) are wired in here and live in their own modules.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from slipstream.model import ModelConfig, Transformer
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.weights import load_model, new_model_dir
from slipstream.ops.allocator import keep_freed_memory, keep_large_freed_memory
from slipstream.perf.flops import mfu, num_params, train_flops_per_token
from slipstream.train import checkpoint as ckpt
from slipstream.train.config import (
    TrainConfig,
    check_run,
    load_config,
    resume_changes,
)
from slipstream.train.context_parallel import ContextParallel, fix_rope_choice
from slipstream.train.cpu_kernels import use_onednn_linears
from slipstream.train.data import TOKENIZER_DIR, TOKENIZER_FILES, TokenDataset, WindowLoader
from slipstream.train.export import tokenization_mismatch
from slipstream.train.faults import FaultInjector
from slipstream.train.goodput import GoodputLedger
from slipstream.train.job import build_train_loader, check_backend, device_type_of, resolve_model_config
from slipstream.train.metrics import MetricsLogger, peak_memory_bytes, perplexity, resolve_peak_flops
from slipstream.train.moe import RouterLogits, Routing, StepRouting, fill_missing_grads
from slipstream.train.optim import WarmupDecay, build_optimizer
from slipstream.train.parallel import (
    DistInfo,
    all_reduce_mean,
    any_rank,
    barrier,
    build_mesh,
    checkpoint_group,
    clip_grad_norm_,
    data_parallel_rank,
    destroy_distributed,
    init_distributed,
    materialize,
    parallelize,
    set_gradient_sync,
)
from slipstream.train.pipeline import (
    StageModule,
    average_grads,
    build_schedule,
    build_stage_modules,
    data_parallel_mesh,
    forward_only,
    make_pipeline,
    mean_over_microbatches,
    parallelize_stages,
    prune_to_stages,
    reshard_stages,
    sum_tied_embedding_grads,
    tied_embedding_group,
    tied_embedding_weight,
)
from slipstream.train.preemption import Preempted, PreemptionHandler
from slipstream.train.profiling import StepProfiler, WrittenTrace
from slipstream.train.rng import rng_state, seed_everything, set_rng_state
from slipstream.train.supervisor import (
    WORKERS_LOCK,
    SkippedWindows,
    Watchdog,
    attempts_without_progress,
    job_world_size,
    lock_run_dir,
    restart_backoff_s,
    restart_count,
)

logger = logging.getLogger(__name__)

StepHook = Callable[["Trainer", dict[str, Any]], None]


class Trainer:
    """One rank's training job: built from a `TrainConfig`, run with `run()` (or step by step
    with `train_step()`), closed with `close()`. `console` receives the rank-0 console lines
    (default: logging); `hooks` are called as `hook(trainer, record)` after every step;
    `started_at` is the wall-clock time this attempt began (the CLI passes its process's
    start, so the goodput ledger charges interpreter start-up too; default: now).

    From the start of its construction until `close()`, rank 0 holds the run dir's workers lock
    (a second trainer there, in any process, gets a ValueError naming the holder's pid) and the
    trainer turns SIGTERM into `preemption.requested`: `run()` honours it at the next step
    boundary; a SIGTERM while the trainer is being built makes construction raise `Preempted`
    (a SystemExit with status 0) at the next stage of it; a loop of your own polls the flag.
    `preemption`, when given, is a handler the caller installed earlier and removes itself
    (`slipstream train` installs one before it imports torch); a SIGTERM it has already turned
    into a request stops the trainer at its first stage."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        console: Callable[[str], None] | None = None,
        hooks: Sequence[StepHook] = (),
        started_at: float | None = None,
        preemption: PreemptionHandler | None = None,
    ) -> None:
        self.config = config
        self.hooks = list(hooks)
        self.step = 0
        self.tokens_seen = 0
        self._started_at = time.time() if started_at is None else started_at
        self._closed = False
        self._held = contextlib.ExitStack()
        """What the trainer holds until `close()`, or a construction that fails, releases it (the
        newest first): metrics, the prefetch thread, the deterministic setting, the ledger, the
        run-dir lock, the process group, the SIGTERM handler."""
        # SIGTERM is a preemption request from the start, so that one landing while the trainer
        # is built (loading data, the model, a checkpoint) stops it cleanly, not the default way.
        if preemption is None:
            preemption = PreemptionHandler()
            preemption.install()
            self._held.callback(preemption.uninstall)
        self.preemption = preemption
        try:
            self._build(console)
        except BaseException:  # a failure or `Preempted`: release what was taken so far
            self._held.close()
            raise

    # ---- set-up -------------------------------------------------------------------------------

    def _build(self, console: Callable[[str], None] | None) -> None:
        """Everything the trainer is made of, in order, stopping between stages when preempted."""
        start = time.perf_counter()
        config = self.config
        self._set_up_process()
        self._stop_if_preempted()
        self.dataset = TokenDataset(config.data.path)
        self.tokenizer = Tokenizer.from_pretrained(self.dataset.tokenizer_dir)
        self.model_config = resolve_model_config(config, self.tokenizer)
        if self.dist.is_main and (mismatch := tokenization_mismatch(self.dataset.tokenizer_dir,
                                                                    self.model_config.model_type)):
            logger.warning("`slipstream export` will refuse this run: %s", mismatch)
        tp, cp = config.parallel.tensor_parallel_degree, config.parallel.context_parallel_degree
        pp = config.parallel.pipeline_parallel_degree
        self.mesh = build_mesh(self.dist, tp, cp, pp)
        self.replica, self.num_replicas = data_parallel_rank(self.dist, tp, cp, pp)
        """This rank's data-parallel replica and their number: the ranks of one replica (its
        context- and tensor-parallel groups, its pipeline's stages) read the same batches."""
        self.pipeline = None if pp == 1 else make_pipeline(
            self.mesh, config.parallel.pipeline_parallel_stages_per_rank,
            config.parallel.pipeline_parallel_schedule)
        """This rank's pipeline stages and group; None without pipeline parallelism."""
        self.context_parallel = None if cp == 1 else ContextParallel(
            self.mesh["cp"].get_group(), self.mesh["cp"].get_local_rank(), cp, config.data.seq_len,
            self.device)
        """Which tokens of each sequence this rank keeps, and the attention that gathers the rest's
        keys and values; None without context parallelism."""
        self.model = self._build_model()
        self.router_logits = RouterLogits(
            self.model, None if self.context_parallel is None else self.mesh["cp"].get_group(),
        ) if self.model_config.moe_layers else None
        """The routers' logits of a mixture-of-experts model (load-balancing loss over each forward's
        tokens on its whole context-parallel group, expert load)."""
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device)
        self.lr_scheduler = self._build_lr_scheduler(steps_taken=0)
        if self.dist.is_main:
            _warn_about_warmup(config)
        # This run's settings of each parameter group (lr, betas, weight decay, ...), which a
        # loaded optimizer state would otherwise replace with the saving run's.
        self._optimizer_settings = [{k: v for k, v in group.items() if k != "params"}
                                    for group in self.optimizer.param_groups]
        self.accumulation_steps = config.training.global_batch_size // (
            self.num_replicas * config.training.micro_batch_size
        )
        self.schedule = None if self.pipeline is None else build_schedule(
            self.stage_modules, self.pipeline, config.parallel.pipeline_parallel_schedule,
            self.accumulation_steps, self.device)
        """torch's pipeline schedule over this rank's stages, whose micro-batches are the step's
        accumulation micro-batches; None without pipeline parallelism."""
        self.train_loader = build_train_loader(config, self.dataset, self.dist.rank, self.dist.world_size,
                                               pin_memory=self.device.type == "cuda")
        self._held.callback(self.train_loader.close)
        self.val_loader = self._build_val_loader()
        self.flops_per_token = train_flops_per_token(self.model_config, config.data.seq_len)
        self._build_resilience()
        self._stop_if_preempted()  # before the run dir is written and a checkpoint loaded
        if self.dist.is_main:
            self._write_run_dir()
        self.peak_flops_per_s, self.peak_source = self._resolve_peak()
        self.metrics = MetricsLogger(
            self.run_dir, enabled=self.dist.is_main, console=console,
            console_interval=config.logging.interval, tensorboard=config.logging.tensorboard,
        )
        self._held.callback(self.metrics.close)
        restore_s = self._resume()
        self._stop_if_preempted()
        self.profiler = StepProfiler(config.profiling, self.run_dir, rank=self.dist.rank,
                                     device_type=self.device.type)
        self.time_s = {"startup": time.perf_counter() - start, "eval": 0.0, "checkpoint": 0.0,
                       "profiling": 0.0}
        """Seconds spent outside steps: building the trainer, evaluations, checkpoints, writing
        profiler traces."""
        self._record_start()
        self.ledger.record("ready", process_start=self._started_at, restore_s=restore_s,
                           backoff_s=self._backoff_s, step=self.step)

    def _set_up_process(self) -> None:
        """Restart backoff, process group, checks that need it, the run-dir lock and the goodput
        ledger (rank 0), seeds, deterministic mode, CPU allocator."""
        config = self.config
        device_type = device_type_of(config.training.device)
        failures = attempts_without_progress(config.run.dir) if restart_count() > 0 else 0
        self._backoff_s = restart_backoff_s(config.supervisor, failures)
        if self._backoff_s:
            logger.warning("restart %d after %d attempt(s) without a checkpoint: waiting %.1fs",
                           restart_count(), failures, self._backoff_s)
            self.preemption.wait(self._backoff_s)
        check_backend(config.parallel.backend, device_type, job_world_size())
        was_initialized = torch.distributed.is_initialized()
        self.dist: DistInfo = init_distributed(device_type, config.parallel.backend)
        if torch.distributed.is_initialized() and not was_initialized:
            self._held.callback(destroy_distributed)
        self.device = self.dist.device
        check_run(config, self.dist.world_size)
        self.run_dir = Path(config.run.dir)
        # Every rank checks before rank 0 rewrites config.toml: that comes after `materialize`,
        # a collective that every rank enters later.
        self.config_changes = _check_resumable(self.run_dir, config)
        if self.dist.is_main:  # one job per run dir, also for a trainer built in Python
            self._held.enter_context(lock_run_dir(self.run_dir, WORKERS_LOCK))
        self.ledger = GoodputLedger(self.run_dir, enabled=self.dist.is_main)
        self._held.callback(self.ledger.close)
        self._held.callback(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled())
        seed_everything(config.training.seed + self.dist.rank, config.training.deterministic)
        if device_type == "cpu":
            keep_freed_memory()
            keep_large_freed_memory()

    def _build_resilience(self) -> None:
        """Checkpoint manager, fault injector, skipped windows, watchdog."""
        config, info = self.config, self.dist
        self.faults = FaultInjector(config.faults, self.run_dir, info.rank)
        self.hooks.append(self.faults.after_step)
        self.checkpoints = ckpt.CheckpointManager(
            self.run_dir, rank=info.rank, world_size=info.world_size,
            process_group=checkpoint_group(info), keep_last=config.checkpoint.keep_last,
            keep_every=config.checkpoint.keep_every, async_save=config.checkpoint.async_save,
            tensor_parallel_degree=config.parallel.tensor_parallel_degree,
            pipeline_parallel_degree=config.parallel.pipeline_parallel_degree,
            on_files_written=self.faults.on_checkpoint_written,
            on_commit=lambda step, path: self.ledger.record("commit", step=step),
        )
        self.skipped_windows = SkippedWindows(self.run_dir, writable=info.is_main)
        self.watchdog = Watchdog(config.supervisor.hang_timeout_s, self.run_dir, info.rank, info.attempt,
                                 first_timeout_s=config.supervisor.first_step_timeout_s)
        self._code_version = ckpt.code_version() if info.is_main else {}
        self._saved_step: int | None = None
        self.resumed_from: int | None = None

    def _stop_if_preempted(self) -> None:
        """Between the stages of construction: when any rank has received SIGTERM, stop before
        training. There is nothing new to save, and the committed checkpoints stay as they are;
        the ledger records an attempt that started and was preempted, and `Preempted` ends the
        process with status 0, as a preemption at a step boundary does."""
        if not any_rank(self.preemption.requested, self.dist):
            return
        self._record_start()
        self.ledger.record("end", reason="preempted", starting=True)
        logger.warning("SIGTERM while starting: stopped before training; rerun the command to resume")
        raise Preempted

    def _record_start(self) -> None:
        self.ledger.record("start", process_start=self._started_at, attempt=self.dist.attempt,
                           restarts=restart_count(), world_size=self.dist.world_size)

    def _resume(self) -> float:
        """Load the newest valid checkpoint of the run dir, if any; returns the seconds it took."""
        start = time.perf_counter()
        for change in self.config_changes:
            self.metrics.log({"kind": "config_change", "step": 0, "change": change})
            logger.warning("resuming with a changed config: %s", change)
        path, skipped = self.checkpoints.newest()
        if path is None and skipped:
            raise ckpt.none_verifies(self.run_dir, skipped)
        if path is None:
            return 0.0
        state = self.load_checkpoint(path)
        self.resumed_from = self._saved_step = self.step
        restore_s = time.perf_counter() - start
        self.metrics.log({"kind": "resume", "step": self.step, "path": str(path), "skipped": skipped,
                          "resharded": state["resharded"], "restore_s": restore_s})
        return restore_s

    def _build_model(self) -> nn.Module:
        """Meta-device model -> this rank's pipeline stages -> CPU fast path -> parallelize ->
        weights from rank 0. With pipeline parallelism the model is this rank's pruned copy
        (`pipeline.prune_to_stages`) and `stage_modules` are the stages the schedule runs."""
        with torch.device("meta"):
            model = Transformer(self.model_config)
        if self.pipeline is not None:
            prune_to_stages(model, self.pipeline)
        # The oneDNN op has no DTensor sharding rule, so tensor-parallel linears stay nn.Linear.
        if (self.config.training.fast_kernels and self.device.type == "cpu"
                and self.config.parallel.tensor_parallel_degree == 1):
            use_onednn_linears(model)
        self.stage_modules: list[StageModule] = []
        if self.pipeline is None:
            parallelize(model, self.mesh, self.config.parallel)
        else:
            cp = self.context_parallel  # every micro-batch's tokens sit at the same positions
            positions = (torch.arange(self.config.data.seq_len, device=self.device) if cp is None
                         else cp.positions)
            self.stage_modules = build_stage_modules(model, self.pipeline, positions,
                                                     None if cp is None else cp.attention)
            parallelize_stages(model, self.stage_modules, self.mesh, self.config.parallel)
            self._build_pipeline_groups()
        full_state = initial_state(self.config, self.model_config) if self.dist.is_main else {}
        materialize(model, self.device, full_state, distributed=self.mesh is not None,
                    part=self.pipeline is not None)
        if self.context_parallel is not None:
            fix_rope_choice(model, self.config.data.seq_len)
        return model

    def _build_pipeline_groups(self) -> None:
        """The groups a pipeline step reduces gradients over beyond the schedule's own: the first
        and last stages' pair for a tied embedding, the stage's data-parallel replicas under DDP."""
        assert self.mesh is not None and self.pipeline is not None
        # In a V the first rank holds the first and the last stage: one table, whose two uses add up
        # in its one gradient. (Every rank decides alike: making a group is collective.)
        self._tied_group = (tied_embedding_group(self.mesh) if self.model_config.tie_word_embeddings
                            and not self.pipeline.v_shape else None)
        dp_mesh = data_parallel_mesh(self.mesh)
        ddp = dp_mesh is not None and self.config.parallel.strategy == "ddp"
        self._ddp_group = dp_mesh.get_group() if ddp else None

    def _build_val_loader(self) -> WindowLoader | None:
        if self.config.eval.interval == 0:
            return None
        try:
            loader = WindowLoader(
                self.dataset.tokens("val"), seq_len=self.config.data.seq_len,
                batch_size=self.config.training.micro_batch_size, rank=self.replica,
                world_size=self.num_replicas, shuffle=False, prefetch=0,
                vocab_size=self.dataset.vocab_size,
            )
        except ValueError as e:
            logger.warning("evaluation disabled: the held-out split is too small (%s)", e)
            return None
        # Evaluation reads whole global batches, so that every layout scores the same windows.
        if loader.num_windows < self.config.training.global_batch_size:
            logger.warning("evaluation disabled: the held-out split has %d windows of %d tokens, fewer "
                           "than one global batch (%d)", loader.num_windows, self.config.data.seq_len,
                           self.config.training.global_batch_size)
            return None
        return loader

    def _resolve_peak(self) -> tuple[float, str]:
        # Rank 0 measures (or reads the cache) first, so ranks do not calibrate against each other.
        if not self.dist.is_main:
            barrier(self.dist)
        peak = resolve_peak_flops(self.device, self.config.training.dtype,
                                  self.config.logging.peak_flops_per_s)
        if self.dist.is_main:
            barrier(self.dist)
        return peak

    def _write_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.config.to_toml(), encoding="utf-8")
        self.model_config.save_pretrained(self.run_dir / "model")
        copy_tokenizer(self.dataset.tokenizer_dir, self.run_dir / TOKENIZER_DIR)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to `training.steps`, evaluating and checkpointing on schedule; returns the last
        train record. A non-finite loss rolls back to the newest checkpoint; SIGTERM saves a
        checkpoint and returns early (the ranks agree on it at a step boundary). With
        `profiling.enable_profiling` the loop runs under the profiler (`train.profiling`)."""
        self.metrics.log(self.run_record())
        record: dict[str, Any] = {}
        outcome = "failed"
        self.watchdog.start()
        try:
            self.profiler.start(self.step)
            while self.step < self.config.training.steps:
                if any_rank(self.preemption.requested, self.dist):
                    self._stop_for_preemption()
                    outcome = "preempted"
                    break
                self._record_trace(self.profiler.step(self.step))
                self.faults.before_step(self)
                step_record = self.train_step()
                if math.isfinite(step_record["loss"]):
                    record = step_record
                    self._finish_step(record)
                else:
                    self._roll_back(step_record)
            else:
                outcome = "finished"
        finally:
            self.close(outcome)
        return record

    def _finish_step(self, record: dict[str, Any]) -> None:
        """Log the step, run the hooks, then evaluate and checkpoint when they are due."""
        config = self.config
        self.metrics.log(record)
        self.ledger.record("step", step=self.step, step_s=record["step_s"], data_s=record["data_wait_s"])
        self.watchdog.progress()  # the step is done; what follows (hooks, eval, saves) is timed
        for hook in self.hooks:
            hook(self, record)
        last = self.step == config.training.steps
        if self.val_loader is not None and (self.step % config.eval.interval == 0 or last):
            self.metrics.log(self.evaluate())
        interval = config.checkpoint.interval
        if (interval and self.step % interval == 0) or (last and config.checkpoint.save_final):
            self.save_checkpoint()
        self._log_saves()

    def _roll_back(self, record: dict[str, Any]) -> None:
        """After a non-finite loss: remember where the step's batches start (so they are
        skipped from now on, also after restarts), reload the newest checkpoint."""
        bad_step, loss = self.step, record["loss"]
        self.skipped_windows.add(record["data_epoch"], record["data_position"], step=bad_step,
                                 loss=str(loss))
        self.ledger.record("step", step=bad_step, step_s=record["step_s"], data_s=record["data_wait_s"])
        if len(self.skipped_windows) > self.config.supervisor.max_rollbacks:
            raise RuntimeError(f"non-finite loss ({loss}) at step {bad_step}, more than "
                               f"supervisor.max_rollbacks = {self.config.supervisor.max_rollbacks}")
        start = time.perf_counter()
        path, _ = self.checkpoints.newest()
        if path is None:
            raise RuntimeError(
                f"non-finite loss ({loss}) at step {bad_step} before the first checkpoint: nothing "
                f"to roll back to; a rerun starts over and skips that step's batches"
            )
        self.load_checkpoint(path)
        self._saved_step = self.step
        restore_s = time.perf_counter() - start
        self.ledger.record("rollback", from_step=bad_step, to_step=self.step, restore_s=restore_s)
        self.metrics.log({"kind": "rollback", "step": bad_step, "loss": str(loss), "to_step": self.step,
                          "data_epoch": record["data_epoch"], "data_position": record["data_position"],
                          "restore_s": restore_s})
        logger.warning("non-finite loss at step %d: rolled back to step %d, skipping its batches",
                       bad_step, self.step)

    def _stop_for_preemption(self) -> None:
        if self._saved_step != self.step:
            self.save_checkpoint(wait=True)
        self.checkpoints.wait()
        self._log_saves()
        self.metrics.log({"kind": "preempted", "step": self.step})
        logger.warning("SIGTERM: checkpoint of step %d saved; rerun the command to resume", self.step)

    def _skip_windows(self) -> dict[str, int]:
        """Pass over steps' batches that start where a non-finite loss was seen; returns the
        loader state where this step's batches start."""
        state = self.train_loader.state_dict()
        while (state["epoch"], state["position"]) in self.skipped_windows:
            for _ in range(self.accumulation_steps):
                next(self.train_loader)
            self.metrics.log({"kind": "skip", "step": self.step + 1, "data_epoch": state["epoch"],
                              "data_position": state["position"]})
            state = self.train_loader.state_dict()
        return state

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `accumulation_steps` micro-batches; returns its record."""
        start = time.perf_counter()
        data_state = self._skip_windows()
        step_routing = StepRouting() if self.router_logits is not None else None
        if self.pipeline is None:
            loss_mean, data_wait_s, forward_backward_s = self._accumulate(step_routing)
        else:
            loss_mean, data_wait_s, forward_backward_s = self._pipeline_forward_backward()
        num_tokens = (self.accumulation_steps * self.config.training.micro_batch_size
                      * self.config.data.seq_len * self.num_replicas)
        t2 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        if step_routing is not None:
            fill_missing_grads(self.model)
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        optimizer_s = time.perf_counter() - t2
        loss_value = self._mean_over_replicas(loss_mean)
        routing_fields = step_routing.record(self.dist) if step_routing is not None else {}
        self.step += 1
        self.tokens_seen += num_tokens
        step_s = time.perf_counter() - start
        return self._train_record(loss_value, grad_norm.item(), lr, num_tokens, step_s, {
            "data_wait_s": data_wait_s, "forward_backward_s": forward_backward_s,
            "optimizer_s": optimizer_s, "data_epoch": data_state["epoch"],
            "data_position": data_state["position"], **routing_fields,
        })

    def _accumulate(self, step_routing: StepRouting | None) -> tuple[torch.Tensor, float, float]:
        """Forward and backward of the step's micro-batches one after another, accumulating
        gradients; returns this rank's mean loss, the seconds waiting for data and computing."""
        data_wait_s = forward_backward_s = 0.0
        loss_sum = torch.zeros((), device=self.device)
        for micro_step in range(self.accumulation_steps):
            t0 = time.perf_counter()
            batch = next(self.train_loader)
            inputs = batch.inputs.to(self.device, non_blocking=True)  # (B, T)
            targets = batch.targets.to(self.device, non_blocking=True)  # (B, T)
            t1 = time.perf_counter()
            set_gradient_sync(self.model, micro_step == self.accumulation_steps - 1)
            loss, routing = self._objective(inputs, targets)
            with self._loss_parallel():  # its backward needs the context as its forward did
                (loss / self.accumulation_steps).backward()
            loss_sum += loss.detach()
            if step_routing is not None:
                step_routing.add(routing)
            self._synchronize()
            data_wait_s += t1 - t0
            forward_backward_s += time.perf_counter() - t1
        return loss_sum / self.accumulation_steps, data_wait_s, forward_backward_s

    def _pipeline_forward_backward(self) -> tuple[torch.Tensor, float, float]:
        """The step's micro-batches (the windows `_accumulate` reads, in its order) through the
        pipeline schedule, then the gradient reductions the schedule does not make (the tied
        embedding's copies, DDP's replicas); returns this rank's mean loss (0 but on the last
        stage), the seconds waiting for data and computing."""
        assert self.schedule is not None and self.pipeline is not None
        t0 = time.perf_counter()
        inputs, targets = self._next_step_batches(self.train_loader)  # (m B, T) each
        t1 = time.perf_counter()
        losses: list[torch.Tensor] = []
        with self._autocast(), self._loss_parallel():  # the loss's backward runs in the schedule
            self._run_schedule(self.schedule.step, inputs, targets, losses)
        mean_over_microbatches(self.model, self.accumulation_steps)
        sum_tied_embedding_grads(self.model, self._tied_group)
        if self._ddp_group is not None:
            average_grads(list(self.model.parameters()), self._ddp_group)
        self._synchronize()
        return self._pipeline_loss(losses), t1 - t0, time.perf_counter() - t1

    def _next_step_batches(self, loader: WindowLoader) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `accumulation_steps` micro-batches of `loader`, stacked (m B, T) each, or
        (m B, T / C) this rank's tokens under context parallelism."""
        batches = [next(loader) for _ in range(self.accumulation_steps)]
        # Each from its (pinned) batch, then joined on the device: a cat on the host would copy
        # them into unpinned memory, whose copy to a GPU is synchronous.
        inputs = torch.cat([b.inputs.to(self.device, non_blocking=True) for b in batches])
        targets = torch.cat([b.targets.to(self.device, non_blocking=True) for b in batches])
        if self.context_parallel is not None:
            inputs, targets, _, _ = self.context_parallel.shard(inputs, targets)
        return inputs, targets

    def _run_schedule(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor,
                      losses: list[torch.Tensor]) -> None:
        """`schedule.step` or `schedule.eval`: inputs go to the first stage, targets to the last."""
        assert self.pipeline is not None
        args = (inputs,) if self.pipeline.has_first else ()
        run(*args, target=targets if self.pipeline.has_last else None, losses=losses)

    def _pipeline_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses (whole, from a loss-parallel DTensor)."""
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
                            for loss in losses]).mean()

    def _mean_over_replicas(self, loss: torch.Tensor) -> float:
        """The mean over the data-parallel replicas of each rank's mean loss: over every rank, or
        with pipeline parallelism over the last stages (the only ranks with a loss, 1 in pp)."""
        mean = all_reduce_mean(loss, self.dist)
        if self.pipeline is not None:
            mean = mean * self.pipeline.pp
        return mean.item()

    def _clip_grad_norm(self) -> torch.Tensor:
        """The gradient norm over every stage and replica, clipped to training.max_grad_norm."""
        parameters = list(self.model.parameters())
        if self.pipeline is None:
            return clip_grad_norm_(parameters, self.config.training.max_grad_norm)
        tied = tied_embedding_weight(self.model) if not self.pipeline.has_first else None
        counted = [p for p in parameters if p is not tied]
        return clip_grad_norm_(parameters, self.config.training.max_grad_norm, counted=counted,
                               pipeline_group=self.pipeline.group)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training objective of a (B, T) batch: the mean next-token cross-entropy (fp32),
        plus `router_aux_loss_coef` x the load-balancing loss for a mixture-of-experts model
        with `output_router_logits` (transformers' loss for that model and batch). Not with
        pipeline parallelism, where `model` is one rank's stages and the schedule computes it
        (ValueError)."""
        return self._objective(inputs, targets)[0]

    def _objective(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Routing | None]:
        """`loss(inputs, targets)` and, for a mixture-of-experts model, what its routers did."""
        if self.router_logits is None:
            return self.cross_entropy(inputs, targets), None
        with self.router_logits.collect() as router_logits:
            loss = self.cross_entropy(inputs, targets)
        if not self.model_config.output_router_logits:  # only recorded: no graph kept for it
            router_logits = [logits.detach() for logits in router_logits]
        routing = self.router_logits.routing(router_logits)
        if self.model_config.output_router_logits:
            loss = loss + self.model_config.router_aux_loss_coef * routing.load_balancing_loss
        return loss, routing

    def cross_entropy(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of a (B, T) batch (the held-out loss). ValueError
        with pipeline parallelism (this rank's `model` holds some of the layers)."""
        if self.pipeline is not None:
            raise ValueError(f"Trainer.loss and Trainer.cross_entropy need the whole model, but "
                             f"parallel.pipeline_parallel_degree is {self.pipeline.pp}: each rank holds some "
                             "stages and the schedule computes the loss (train_step, evaluate)")
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)  # (B, T)
        attention = None
        if self.context_parallel is not None:  # this rank's T / C tokens; every rank has as many, so
            # the mean over ranks of these means (the loss record, FSDP's gradient) is the batch's
            inputs, targets, positions, attention = self.context_parallel.shard(inputs, targets)
        with self._autocast():
            # (B, T, V), split by vocabulary under loss parallelism
            logits = self.model(inputs, positions, attention)
        with self._loss_parallel():
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Mean loss over the first `eval.num_batches` global batches of the held-out split (as
        many as it holds, at least one: the loader is off below that)."""
        assert self.val_loader is not None
        start = time.perf_counter()
        self.val_loader.load_state_dict({**self.val_loader.state_dict(), "epoch": 0, "position": 0})
        # The same windows at every world size: num_batches global batches, each rank its share.
        global_batches = min(self.config.eval.num_batches,
                             self.val_loader.num_windows // self.config.training.global_batch_size)
        num_micro_batches = global_batches * self.accumulation_steps
        if self.pipeline is None:
            loss_sum = torch.zeros((), device=self.device)
            for batch in itertools.islice(self.val_loader, num_micro_batches):
                loss_sum += self.cross_entropy(batch.inputs.to(self.device), batch.targets.to(self.device))
            loss = self._mean_over_replicas(loss_sum / num_micro_batches)
        else:
            loss = self._mean_over_replicas(self._pipeline_eval(global_batches))
        eval_s = time.perf_counter() - start
        self.time_s["eval"] += eval_s
        self.ledger.record("eval", step=self.step, eval_s=eval_s)
        num_tokens = num_micro_batches * self.val_loader.global_batch_windows * self.config.data.seq_len
        return {"kind": "eval", "step": self.step, "eval_loss": loss,
                "eval_perplexity": perplexity(loss), "eval_tokens": num_tokens, "eval_s": eval_s}

    def _pipeline_eval(self, global_batches: int) -> torch.Tensor:
        """This rank's mean held-out loss over `global_batches` schedule runs of forwards only
        (`schedule.eval`; under a V schedule `pipeline.forward_only`), each of the step's m
        micro-batches; 0 but on the last stage."""
        assert self.schedule is not None and self.val_loader is not None
        losses: list[torch.Tensor] = []
        for _ in range(global_batches):
            inputs, targets = self._next_step_batches(self.val_loader)
            batch_losses: list[torch.Tensor] = []  # the schedule clears the list it is given
            with self._autocast(), self._loss_parallel():
                if self.pipeline.v_shape:  # torch's schedule.eval fails there
                    first, last = self.pipeline.has_first, self.pipeline.has_last
                    batch_losses = forward_only(self.stage_modules, self.pipeline,
                                                inputs if first else None, targets if last else None,
                                                self.accumulation_steps, self.device)
                else:
                    self._run_schedule(self.schedule.eval, inputs, targets, batch_losses)
            losses += batch_losses
        reshard_stages(self.stage_modules)
        return self._pipeline_loss(losses)

    def close(self, outcome: str = "closed") -> None:
        """Stop the watchdog, wait for the checkpoint in flight, record how the attempt ended
        (`outcome`: finished, preempted, failed, closed), then release what the trainer holds:
        flush metrics, stop the prefetch thread, undo the process-wide deterministic setting (so
        a trainer inside a larger program leaves it as it was), release the run-dir lock, leave
        the process group if this trainer joined it, and restore the SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.stop()
        error = None
        try:
            try:  # the trace of steps the profiler was recording when the loop ended, if any
                self._record_trace(self.profiler.stop())
            finally:
                self.checkpoints.close()
            self._log_saves()
        except Exception as e:  # a failed save or trace: report it unless the run already failed
            if outcome == "failed":  # the run's own error follows; one line for this one
                logger.error("the checkpoint in flight or the profiler trace failed too: %s", e)
            else:
                error = e
        self.ledger.record("end", reason="failed" if error else outcome, step=self.step)
        self._held.close()
        if error is not None:
            raise error

    # ---- records ------------------------------------------------------------------------------

    def _train_record(
        self, loss: float, grad_norm: float, lr: float, num_tokens: int, step_s: float,
        times_s: dict[str, float],
    ) -> dict[str, Any]:
        tokens_per_s = num_tokens / step_s
        tokens_per_s_per_device = tokens_per_s / self.dist.world_size
        return {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": num_tokens,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s_per_device,
            "mfu": mfu(tokens_per_s_per_device, self.flops_per_token, self.peak_flops_per_s),
            **times_s,
            "step_s": step_s,
            "peak_memory_bytes": self._peak_memory_bytes(),
            "attempt": self.dist.attempt,
        }

    def _peak_memory_bytes(self) -> int:
        """This rank's peak memory, or with pipeline parallelism the largest of every rank's: the
        stages differ (the first holds the most micro-batches' activations under 1F1B, the last
        the output layer and the logits), and the record, written by rank 0, reports the bound."""
        peak = peak_memory_bytes(self.device)
        if self.pipeline is None:
            return peak
        value = torch.tensor([peak], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    def run_record(self) -> dict[str, Any]:
        """The "run" record: what is trained, where, and the MFU convention."""
        config = self.config
        tp, cp = config.parallel.tensor_parallel_degree, config.parallel.context_parallel_degree
        return {
            "kind": "run",
            "step": self.step,
            "num_params": num_params(self.model_config),
            "model": config.model.path or config.model.preset,
            "world_size": self.dist.world_size,
            "device": str(self.device),
            "num_threads": torch.get_num_threads(),
            "dtype": config.training.dtype,
            # FSDP / DDP run over the replicas' context-parallel ranks; "single": none applied
            "strategy": config.parallel.strategy if self.num_replicas * cp > 1 else "single",
            "tensor_parallel_degree": tp,
            "sequence_parallel": config.parallel.sequence_parallel and tp > 1,
            "loss_parallel": config.parallel.loss_parallel and tp > 1,
            "context_parallel_degree": cp,
            "pipeline_parallel_degree": config.parallel.pipeline_parallel_degree,
            "pipeline_parallel_schedule": config.parallel.pipeline_parallel_schedule,
            "pipeline_parallel_stages_per_rank": config.parallel.pipeline_parallel_stages_per_rank,
            "seq_len": config.data.seq_len,
            "global_batch_size": config.training.global_batch_size,
            "accumulation_steps": self.accumulation_steps,
            "tokens_per_step": config.training.global_batch_size * config.data.seq_len,
            "flops_per_token": self.flops_per_token,
            "peak_flops_per_s": self.peak_flops_per_s,
            "peak_source": self.peak_source,
            "mfu_convention": "6N + 12*L*H*Q*T per token (PaLM/torchtitan, no causal discount, "
                              "no recompute), per device, over the peak for the matmul dtype",
            "vocab_size": self.model_config.vocab_size,
            "attempt": self.dist.attempt,
            "resumed_from_step": self.resumed_from,
        }

    # ---- state and checkpoints ----------------------------------------------------------------

    def train_state(self) -> dict[str, Any]:
        """Everything but model and optimizer that a resumed run needs (this rank's RNGs)."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "data": self.train_loader.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": rng_state(),
        }

    def load_train_state(self, state: dict[str, Any]) -> None:
        """Restore `train_state()`; RNG states only when present (a rank the saving job did not
        have keeps its fresh seed)."""
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.train_loader.load_state_dict(state["data"])
        self._resume_optimizer_settings(state["lr_scheduler"]["last_epoch"])
        if "rng" in state:
            set_rng_state(state["rng"])

    def _build_lr_scheduler(self, steps_taken: int) -> torch.optim.lr_scheduler.LambdaLR:
        """This run's schedule, with the learning rate set for the optimizer step after
        `steps_taken` (LambdaLR's `last_epoch` counts the steps taken before it)."""
        schedule = WarmupDecay(self.config.schedule, self.config.training.steps)
        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule, last_epoch=steps_taken - 1)

    def _resume_optimizer_settings(self, steps_taken: int) -> None:
        """Keep of a loaded optimizer and schedule only their state (moments, step counts), and
        take the settings from this run's config: a checkpoint holds the saving run's lr, betas,
        weight decay and schedule (LambdaLR's state even holds its schedule object's fields), and
        a rerun that changes them (its `config_change` records) must train with the new ones. With
        the config unchanged this sets the very values the uninterrupted run has."""
        for group, settings in zip(self.optimizer.param_groups, self._optimizer_settings, strict=True):
            group.update(settings)
        self.lr_scheduler = self._build_lr_scheduler(steps_taken)

    def save_checkpoint(self, *, wait: bool = False) -> Path:
        """Save the current state (in the background with `checkpoint.async_save`; with `wait`,
        return once it is committed); returns the folder it commits to. Every rank calls it."""
        stall_s = self.checkpoints.save(self.step, self.model, self.optimizer, self.train_state(),
                                        self._checkpoint_meta(), self.model_config)
        if wait:
            start = time.perf_counter()
            self.checkpoints.wait()
            stall_s += time.perf_counter() - start
        self.time_s["checkpoint"] += stall_s
        self.ledger.record("checkpoint", step=self.step, stall_s=stall_s)
        self._saved_step = self.step
        return ckpt.checkpoint_dir(self.run_dir, self.step)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint (written at any world size) into this trainer; returns its train
        state. Every rank calls it."""
        state = self.checkpoints.load(path, self.model, self.optimizer)
        self.load_train_state(state)
        return state

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "code_version": self._code_version,
                "attempt": self.dist.attempt, "time": time.time()}

    def _record_trace(self, trace: WrittenTrace | None) -> None:
        """Charge the writing of a profiler trace as a checkpoint's stall is charged: to
        `time_s`, the goodput ledger (a `profile` event) and a `profile` metrics record."""
        if trace is None:
            return
        self.time_s["profiling"] += trace.seconds
        self.ledger.record("profile", step=trace.step, trace_s=trace.seconds)
        self.metrics.log({"kind": "profile", "step": trace.step, "path": str(trace.path),
                          "trace_s": trace.seconds})

    def _log_saves(self) -> None:
        for result in self.checkpoints.completed():
            self.metrics.log({"kind": "checkpoint", "step": result.step, "path": str(result.path),
                              "checkpoint_s": result.stall_s, "write_s": result.write_s,
                              "bytes": result.num_bytes, "async": self.config.checkpoint.async_save})

    # ---- helpers ------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.training.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        parallel = self.config.parallel
        if parallel.tensor_parallel_degree > 1 and parallel.loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ---- building blocks (public: tests and the benchmark use them) -------------------------------


def initial_state(config: TrainConfig, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """The full fp32 starting weights: a seeded initialisation, or the model dir's weights."""
    if config.model.path is not None:
        return load_model(config.model.path, dtype=torch.float32).state_dict()
    with torch.device("meta"):
        model = Transformer(model_config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty made the tied output projection a parameter of its own
    model.init_weights(std=config.model.init_std,
                       generator=torch.Generator().manual_seed(config.model.init_seed))
    return model.state_dict()


def copy_tokenizer(source: Path, target: Path) -> None:
    """Put a copy of the tokenizer folder `source` (its `data.TOKENIZER_FILES`) at `target`,
    replacing the copy an earlier attempt of the run wrote there. A folder at `target` that holds
    anything but tokenizer files, or is no plain folder, is left alone (ValueError): this deletes
    nothing but an earlier copy. The copy is written beside `target` and swapped in
    (`new_model_dir`: made with the umask's mode; what a kill leaves is a hidden `.tmp-tokenizer-`
    folder beside it, which the next call removes before it copies again)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ValueError(f"run.dir's {target} is not a tokenizer folder a run wrote (it is no plain "
                         "folder); move it away or choose another run.dir")
    existing = target.iterdir() if target.exists() else ()
    others = sorted(p.name for p in existing if p.name not in TOKENIZER_FILES)
    if others:
        raise ValueError(f"run.dir's {target} is not a tokenizer folder a run wrote (it holds {others}); "
                         "move it away or choose another run.dir")
    with new_model_dir(target, overwrite=True) as staging:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)


def _warn_about_warmup(config: TrainConfig) -> None:
    """A warm-up as long as the run never reaches optimizer.lr; a longer one is also cut to the
    run's length (`optim.WarmupDecay`, as torchtitan), so a resume that extends training.steps
    lengthens it again and the learning rate drops at the resume. Logged by the main rank."""
    warmup, steps = config.schedule.warmup_steps, config.training.steps
    if warmup >= steps:
        cut = (f"; the warm-up is cut to {steps} steps, so a resume that extends training.steps warms "
               "up longer and the learning rate drops at the resume (set schedule.warmup_steps to the "
               "length you mean)") if warmup > steps else ""
        logger.warning("schedule.warmup_steps (%d) >= training.steps (%d): the learning rate warms up "
                       "for the whole run and never reaches optimizer.lr%s", warmup, steps, cut)


def _check_resumable(run_dir: Path, config: TrainConfig) -> list[str]:
    """The config changes of a rerun in a run dir that holds a run (ValueError if it holds
    another run: see `config.RESUME_IDENTITY`); [] for a new run dir."""
    saved = run_dir / "config.toml"
    if saved.is_file():
        return resume_changes(load_config(saved), config)
    if ckpt.list_checkpoints(run_dir):
        raise ValueError(f"run.dir {str(run_dir)!r} holds checkpoints but no config.toml; "
                         "choose a new run.dir")
    return []
