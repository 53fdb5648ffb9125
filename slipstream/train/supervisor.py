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
  collective: it writes every thread's stack to RUN_DIR/stacks/ and exits with status 1,
  which the agent treats as a failure. When one rank hangs, its peers block in the next
  collective and their watchdogs fire too, so every rank leaves its stacks. SIGUSR1 dumps the
  stacks of a live rank on demand.
- preemption (`PreemptionHandler`): SIGTERM (sent by a scheduler to the launcher, which
  forwards it through torchrun to every worker) sets a flag; at the next step boundary the
  ranks agree on it, save a checkpoint, and exit with status 0 so the agent does not restart
  them. Rerunning the command resumes.
- restart backoff (`restart_backoff_s`): a restarted worker sleeps before joining when the
  attempts before it committed no checkpoint, doubling per such attempt, so a crash loop does not
  hammer a failing dependency.
- non-finite loss: rolled back in process by the trainer (`Trainer._roll_back`).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from slipstream.train.config import SupervisorConfig
from slipstream.train.goodput import LEDGER_FILE

logger = logging.getLogger(__name__)

STACKS_DIR = "stacks"


class Watchdog:
    """Dump every thread's stack and exit when `progress()` is not called again within
    `timeout_s` (0 disables it). `start()` opens the stack file and registers SIGUSR1; the
    first `progress()` (after the first step, so start-up and compilation are not timed) arms
    it; `stop()` disarms it."""

    def __init__(self, timeout_s: float, run_dir: str | Path, rank: int, attempt: int) -> None:
        self.timeout_s = timeout_s
        self.path = Path(run_dir) / STACKS_DIR / f"attempt-{attempt}-rank-{rank}.txt"
        self._file = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 (faulthandler writes to it until stop)
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self._file, all_threads=True)

    def progress(self) -> None:
        if self._file is not None and self.timeout_s > 0:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self._file)

    def stop(self) -> None:
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            faulthandler.unregister(signal.SIGUSR1)
        self._file.close()
        self._file = None
        if self.path.stat().st_size == 0:
            self.path.unlink()


class PreemptionHandler:
    """Turns SIGTERM into a flag the training loop polls between steps; a second SIGTERM
    terminates at once. Installed only from the main thread (signals arrive there)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            self.uninstall()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        logger.warning("SIGTERM: saving a checkpoint at the end of this step, then exiting")
        self.requested = True


def restart_count() -> int:
    """How often torchrun's agent on this node has restarted the workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_backoff_s(config: SupervisorConfig, failures_in_a_row: int) -> float:
    """Seconds a restarted worker waits when the last `failures_in_a_row` attempts committed no
    checkpoint: none after an attempt that made progress, then the backoff, doubled each time,
    capped (a crash loop backs off; failures minutes apart do not pay for each other, as with
    Kubernetes' CrashLoopBackOff, which resets once a container has run well)."""
    if failures_in_a_row <= 0:
        return 0.0
    return min(config.restart_backoff_s * 2 ** (failures_in_a_row - 1), config.max_backoff_s)


def attempts_without_progress(run_dir: str | Path) -> int:
    """How many attempts in a row, up to the newest, started and committed no checkpoint (from
    the run's goodput ledger; 0 for a new run)."""
    path = Path(run_dir) / LEDGER_FILE
    if not path.is_file():
        return 0
    count = 0
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)["event"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
        if event == "commit":
            count = 0
        elif event == "start":
            count += 1
    return count


def torchrun_command(nproc: int, max_restarts: int, train_args: Sequence[str]) -> list[str]:
    """torchrun on this host running `slipstream train train_args` in `nproc` processes, with
    the elastic agent restarting them at most `max_restarts` times."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        "-m", "slipstream.cli", "train", *train_args,
    ]


def launch(command: Sequence[str]) -> int:
    """Run the launcher command, forwarding SIGTERM and SIGINT to it (torchrun passes them on to
    the workers, which save a checkpoint and exit); returns its exit status."""
    child = subprocess.Popen(command)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
