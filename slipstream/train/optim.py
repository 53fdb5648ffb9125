"""AdamW and the learning-rate schedule of a training run."""

from __future__ import annotations

import math

import torch
from torch import nn

from slipstream.train.config import OptimizerConfig, ScheduleConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms or biases), fused where it can be."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type in ("cpu", "cuda") else "foreach"
    kwargs = {"fused": implementation == "fused", "foreach": implementation == "foreach"}
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **kwargs)


class WarmupDecay:
    """LR multiplier for `LambdaLR`: linear warm-up, then cosine / linear / constant decay.

    A warm-up longer than the run is cut to the run's `total_steps`, as torchtitan's
    `build_lr_schedulers` does (the trainer warns): the warm-up then spans the whole run, ending
    at total_steps / (total_steps + 1) of the peak, and a resume with more total_steps warms up
    longer, so its learning rate drops below the one the run left off at."""

    def __init__(self, schedule: ScheduleConfig, total_steps: int) -> None:
        self.warmup_steps = min(schedule.warmup_steps, total_steps)
        self.decay = schedule.decay
        self.min_lr_ratio = schedule.min_lr_ratio
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:  # step: optimizer steps taken so far (0-based)
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape
