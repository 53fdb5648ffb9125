"""Injected faults for tests and drills, from the `[faults]` config section.

`FaultInjector` is handed to the trainer as hooks, so the training code has no fault branches:
`before_step(trainer)` poisons a norm's weight this rank holds with NaN before `nan_at_step`;
`after_step(trainer, record)` exits abruptly after `crash_at_step`, stops making progress after
`hang_at_step`, or sends the process SIGTERM after `preempt_at_step`;
`on_checkpoint_written(step, folder)` (the checkpoint manager's hook between writing the files
and committing them) SIGKILLs the process for `kill_during_checkpoint`. Each fault fires once
per run directory, on `faults.rank` only: a marker file in RUN_DIR/faults/ is created (and
fsynced) before the fault strikes, so the restarted or rerun job passes that step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from slipstream.train.config import FaultConfig

if TYPE_CHECKING:
    from slipstream.train.trainer import Trainer

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 86
"""The exit status of an injected crash, so logs tell it from a real one."""


class FaultInjector:
    def __init__(self, config: FaultConfig, run_dir: str | Path, rank: int) -> None:
        self.config = config
        self.marker_dir = Path(run_dir) / "faults"
        self.active = config.any and rank == config.rank

    def before_step(self, trainer: Trainer) -> None:
        if self._fires("nan", trainer.step + 1, self.config.nan_at_step):
            _poison_weights(trainer.model)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self._fires("crash", trainer.step, self.config.crash_at_step):
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        if self._fires("hang", trainer.step, self.config.hang_at_step):
            while True:
                time.sleep(1)
        if self._fires("preempt", trainer.step, self.config.preempt_at_step):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_checkpoint_written(self, step: int, folder: Path) -> None:
        if self._fires("kill-during-checkpoint", step, self.config.kill_during_checkpoint):
            os.kill(os.getpid(), signal.SIGKILL)

    def _fires(self, name: str, step: int, fault_step: int) -> bool:
        """True once per run dir when `step` is the fault's step (and this rank is targeted)."""
        if not (self.active and fault_step and step == fault_step):
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / f"{name}-step-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.fsync(fd)
        os.close(fd)
        logger.warning("injecting fault %s at step %d", name, step)
        return True


@torch.no_grad()
def _poison_weights(model: torch.nn.Module) -> None:
    """Set this rank's shard of a norm's weight to NaN: the final norm's, or on a pipeline rank
    without the last stage its first layer's post-attention norm (every kind of decoder layer has
    one, on the residual stream or the MLP's input). Every hidden state after it becomes NaN,
    so the loss does on every rank (sharded weights are gathered, activations sent on down the
    pipeline, replicated losses averaged)."""
    decoder = model.model
    norm = decoder.norm
    if norm is None:
        norm = next(iter(decoder.layers.children())).post_attention_layernorm
    weight = norm.weight
    (weight.to_local() if isinstance(weight, DTensor) else weight).fill_(float("nan"))
