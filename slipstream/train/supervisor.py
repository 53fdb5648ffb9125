"""Keeping a training job alive: restarts, a hang watchdog, preemption, restart backoff.

Restarts are torchrun's job, not ours. `slipstream train --max-restarts K [--nproc N]` runs
`torchrun --max-restarts K --nproc_per_node N` (N = 1 included): the elastic agent watches the
workers, and when one exits with an error it stops the others and starts them all again, at
most K times. Everything else happens inside each worker, so it works the same under any
launcher (torchrun on many hosts, a bare `slipstream train` rerun by hand or by a scheduler):

- resume: a starting trainer loads the newest valid checkpoint of its run dir (`Trainer`);
- process group: each attempt joins under a fresh store prefix (`parallel.attempt_store`),
  because the agent's store keeps the dead attempt's peer addresses;
- hang watchdog (`Watchdog`): `faulthandler.dump_traceback_later`, re-armed after every step,
  runs on a C thread that needs no GIL, so it also fires when Python is stuck inside a
  collective: it writes every thread's stack to RUN_DIR/stacks/ (a file per process) and exits
  with status 1, which the agent treats as a failure. When one rank hangs, its peers block in
  the next collective and their watchdogs fire too, so every rank leaves its stacks. SIGUSR1
  dumps the stacks of a live rank on demand.
- preemption (`preemption.PreemptionHandler`): SIGTERM (sent by a scheduler to the launcher, which
  sends it on to each worker once the worker handles it, `launch`) sets a flag, from the start
  of a trainer's construction; at the next step boundary the ranks agree on it, save a
  checkpoint, and exit with status 0, so the agent neither restarts them nor fails. A trainer
  still being built stops at the next stage of its construction instead, with nothing new to
  save (`preemption.Preempted`, status 0). Rerunning the command resumes.
- restart backoff (`restart_backoff_s`): a restarted worker sleeps before joining when the
  attempts before it committed no checkpoint, doubling per such attempt, so a crash loop does not
  hammer a failing dependency.
- checks before anything starts (`check_job`), so a user error is one line, not a restart loop;
- one job per run dir (`lock_run_dir`): the launcher (or a process training on its own) and
  rank 0's trainer hold locks in the run dir that a second job cannot take.
- non-finite loss: rolled back in process by the trainer (`Trainer._roll_back`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from slipstream.train.config import SupervisorConfig, TrainConfig, check_run, load_config, resume_changes
from slipstream.train.goodput import LEDGER_FILE
from slipstream.train.preemption import POLL_S

logger = logging.getLogger(__name__)

STACKS_DIR = "stacks"
JOB_LOCK, WORKERS_LOCK = "job.lock", "workers.lock"


class Watchdog:
    """Dump every thread's stack and exit when `progress()` is not called again within
    `timeout_s` (0 disables it). `start()` opens the stack file, registers SIGUSR1 and arms it
    for `first_timeout_s` (the first step compiles and warms up, so it gets longer); every
    `progress()` re-arms it for `timeout_s`; `stop()` disarms it. The file is named after this
    process too: attempt numbers start at 0 again in every launch, and a rerun must not write
    into an earlier run's stacks."""

    def __init__(self, timeout_s: float, run_dir: str | Path, rank: int, attempt: int,
                 first_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.first_timeout_s = timeout_s if first_timeout_s is None else max(first_timeout_s, timeout_s)
        self.path = Path(run_dir) / STACKS_DIR / f"attempt-{attempt}-rank-{rank}-pid-{os.getpid()}.txt"
        self._file = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 (faulthandler writes to it until stop)
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self._file, all_threads=True)
        self._arm(self.first_timeout_s)

    def progress(self) -> None:
        self._arm(self.timeout_s)

    def _arm(self, timeout_s: float) -> None:
        if self._file is not None and self.timeout_s > 0:
            faulthandler.dump_traceback_later(timeout_s, exit=True, file=self._file)

    def stop(self) -> None:
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            faulthandler.unregister(signal.SIGUSR1)
        self._file.close()
        self._file = None
        with contextlib.suppress(FileNotFoundError):  # removed during the run
            if self.path.stat().st_size == 0:
                self.path.unlink()


def restart_count() -> int:
    """How often torchrun's agent on this node has restarted the workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_world_size() -> int:
    """How many ranks torchrun started this process among (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_backoff_s(config: SupervisorConfig, failures_in_a_row: int) -> float:
    """Seconds a restarted worker waits when the last `failures_in_a_row` attempts committed no
    checkpoint: none after an attempt that made progress, then the backoff, doubled each time,
    capped (a crash loop backs off; failures minutes apart do not pay for each other, as with
    Kubernetes' CrashLoopBackOff, which resets once a container has run well)."""
    if failures_in_a_row <= 0:
        return 0.0
    return min(config.restart_backoff_s * 2 ** (failures_in_a_row - 1), config.max_backoff_s)


def attempts_without_progress(run_dir: str | Path, restarts: int | None = None) -> int:
    """How many attempts in a row, up to the newest, committed no checkpoint (from the run's
    goodput ledger; 0 for a new run). An attempt records `start` only once it is built, so the
    attempts of this launch (`restarts` of them before this one, default `restart_count()`)
    that left no `start` after the ledger's last `launch` failed while starting: they count
    too, as the newest (a failure to start tends to repeat)."""
    restarts = restart_count() if restarts is None else restarts
    path = Path(run_dir) / LEDGER_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    count = starts_since_launch = 0
    for line in lines:
        try:
            event = json.loads(line)["event"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
        if event == "commit":
            count = 0
        elif event == "start":
            count += 1
            starts_since_launch += 1
        elif event == "launch":
            starts_since_launch = 0
    return count + max(restarts - starts_since_launch, 0)


def check_job(config: TrainConfig, world_size: int) -> None:
    """The checks of a job that need no process group, made before any process is started, so
    that a user error is one line (ValueError, FileNotFoundError) and not a restart loop:
    `check_run`, a config that can be written to the run dir's config.toml (a path with a byte
    that is not UTF-8 cannot), the device and backend, the model (a trainable preset, or
    model.path) against the data's tokenizer and seq_len, a training split of at least one step,
    a rerun's config against the run dir's (and the model at its model.path against its
    checkpoints'), a checkpoint to resume from when there are any, and `faults.rank` among the
    ranks. The trainer makes the same checks, with the same functions, when it is built."""
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.train.data import TokenDataset
    from slipstream.train.job import build_train_loader, check_backend, device_type_of, resolve_model_config

    check_run(config, world_size)
    config.to_toml()
    check_backend(config.parallel.backend, device_type_of(config.training.device), world_size)
    dataset = TokenDataset(config.data.path)
    resolve_model_config(config, Tokenizer.from_pretrained(dataset.tokenizer_dir))
    build_train_loader(config, dataset, 0, world_size)
    saved = Path(config.run.dir) / "config.toml"
    if saved.is_file():
        resume_changes(load_config(saved), config)
    _check_checkpoint_shape(config)
    _check_some_checkpoint_loads(config)
    if config.faults.rank >= world_size:
        raise ValueError(f"faults.rank ({config.faults.rank}) must be below the job's number of "
                         f"ranks ({world_size}, set by --nproc)")


SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "attention_bias", "mlp_bias", "num_experts", "moe_intermediate_size",
                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                "num_experts_per_tok", "norm_topk_prob")
"""The `ModelConfig` fields a checkpoint's weights were trained for: their shapes, and which
layers route to experts and how (the top k and its renormalisation)."""


def _check_checkpoint_shape(config: TrainConfig) -> None:
    """ValueError when model.path now holds a model of another shape than the run dir's newest
    checkpoint (the directory was rewritten since the run began: its path, which the rerun
    check compares, is the same). A checkpoint whose config.json is unreadable is the loader's
    to skip."""
    from slipstream.model import ModelConfig
    from slipstream.train.checkpoint import list_checkpoints

    found = list_checkpoints(config.run.dir) if config.model.path is not None else []
    if not found:
        return
    step, path = found[-1]
    try:
        saved = ModelConfig.from_pretrained(path)
    except (ValueError, FileNotFoundError):
        return
    current = ModelConfig.from_pretrained(config.model.path)
    differ = [f"{f} {getattr(saved, f)} -> {getattr(current, f)}" for f in SHAPE_FIELDS
              if getattr(saved, f) != getattr(current, f)]
    if differ:
        raise ValueError(f"model.path {config.model.path!r} holds a model of another shape than the "
                         f"checkpoint of step {step} in run.dir ({', '.join(differ)}): restore the model "
                         "the run began from, or choose a new run.dir")


def _check_some_checkpoint_loads(config: TrainConfig) -> None:
    """ValueError when run.dir holds checkpoints and none has its manifest and files at their
    sizes (the checksums are the workers' to compare): every restart would fail on it."""
    from slipstream.train.checkpoint import newest_checkpoint, none_verifies

    path, skipped = newest_checkpoint(config.run.dir, checksums=False)
    if path is None and skipped:
        raise none_verifies(config.run.dir, skipped)


def lock_run_dir(run_dir: str | Path, name: str) -> IO[str]:
    """Lock RUN_DIR/`name` (flock, exclusive) for as long as the returned file is open in this
    process or any process it passes the file to; the kernel releases it however they end.
    ValueError naming the run dir and the holder's pid when another job holds it."""
    path = Path(run_dir) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a+")  # noqa: SIM115 (held until the caller closes it)
    except OSError as e:  # a file in the way, a read-only file system, no permission
        raise ValueError(f"run.dir {str(run_dir)!r} cannot hold the run: {e.strerror or e} "
                         f"({e.filename or path})") from None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise ValueError(f"run.dir {str(run_dir)!r} is in use by another training job (pid {holder} "
                         f"or processes it started hold {path}); wait for it to end or choose "
                         "another run.dir") from None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file


def refuse_a_busy_run_dir(run_dir: str | Path, names: Sequence[str]) -> None:
    """`lock_run_dir`'s ValueError when another job holds one of the run dir's locks `names`,
    probed without creating anything: a second job is refused before its checks (`check_job`
    imports torch, and reads checkpoints that the first job may be writing)."""
    for name in names:
        if (Path(run_dir) / name).is_file():
            lock_run_dir(run_dir, name).close()


def process_locks() -> tuple[str, ...]:
    """The run-dir locks `slipstream train` takes before it builds its trainer: the job lock
    for a process of its own; none under torchrun, where the launcher holds it
    (`slipstream train --nproc`; nobody under a bare torchrun). The workers lock is the trainer's
    own, taken by rank 0 (`Trainer`), so that workers which outlive a killed launcher (they run in
    sessions of their own), and trainers built in Python, keep a second job out too."""
    return () if "TORCHELASTIC_RUN_ID" in os.environ else (JOB_LOCK,)


def torchrun_command(nproc: int, max_restarts: int, train_args: Sequence[str]) -> list[str]:
    """torchrun on this host running `slipstream train train_args` in `nproc` processes, with
    the elastic agent restarting them at most `max_restarts` times."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        "-m", "slipstream.cli", "train", *train_args,
    ]


def launch(command: Sequence[str], *, keep_open: IO | None = None) -> int:
    """Run the torchrun command; returns its exit status. The first SIGTERM is passed straight
    to the workers, each as soon as it handles SIGTERM (a trainer does from the start of its
    construction; before, while Python starts, SIGTERM would kill it): they stop cleanly and
    exit with status 0, so torchrun ends with 0 too. Sent to torchrun, it ends with a
    SignalException (status 1) and kills workers whose save outlasts its shutdown timeout.
    SIGINT, a second SIGTERM, and one before any worker runs go to torchrun, which stops the
    workers. torchrun inherits `keep_open` (the run-dir lock)."""
    child = subprocess.Popen(command, pass_fds=() if keep_open is None else (keep_open.fileno(),))
    preempting = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal preempting
        if signum == signal.SIGTERM and not preempting and child_pids(child.pid):
            preempting = True  # passed on by the loop below
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    preempted: set[int] = set()
    try:
        while child.poll() is None:
            if preempting:
                preempt_workers(child.pid, preempted)
            time.sleep(POLL_S)
        return child.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def preempt_workers(parent: int, preempted: set[int]) -> None:
    """SIGTERM each child of `parent` that handles SIGTERM and is not in `preempted` yet, and add
    it there (workers that torchrun starts later, after a failure, get theirs when they are
    ready for it)."""
    for pid in child_pids(parent):
        if pid not in preempted and handles_signal(pid, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            preempted.add(pid)


def handles_signal(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (SigCgt in Linux's /proc;
    False for a process that has exited, and elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from Linux's /proc; none elsewhere)."""
    children = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_file.read_text()
        except OSError:
            continue  # it exited meanwhile
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:  # field 4: the parent's pid
            children.append(int(stat_file.parent.name))
    return children


class SkippedWindows:
    """Where the batches of steps with a non-finite loss started, as (epoch, position) of the
    loader: the trainer passes over a step's batches when they start at one of these. Kept in
    RUN_DIR/skipped_windows.jsonl (written by rank 0), so restarts and reruns skip them too."""

    FILE = "skipped_windows.jsonl"

    def __init__(self, run_dir: str | Path, *, writable: bool) -> None:
        self.path = Path(run_dir) / self.FILE
        self.writable = writable
        self.windows: set[tuple[int, int]] = set()
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.windows.add((entry["epoch"], entry["position"]))

    def add(self, epoch: int, position: int, **info: object) -> None:
        self.windows.add((epoch, position))
        if self.writable:
            with open(self.path, "a") as f:
                f.write(json.dumps({"epoch": epoch, "position": position, **info}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def __contains__(self, window: tuple[int, int]) -> bool:
        return window in self.windows

    def __len__(self) -> int:
        return len(self.windows)
