"""Checkpoint stall: how long the training step is blocked per checkpoint, asynchronous save
against a synchronous save of the same state.

The state is the `small` preset (~125M parameters, fp32) with its AdamW moments after one
optimizer step: about 1.5 GB. Both sides save it through `train.checkpoint.CheckpointManager`,
the trainer's own path (`get_state_dict`, DCP `FileSystemWriter` with fsync, CRC-32 manifest,
atomic rename, retention):

- synchronous (`checkpoint.async_save = false`): the step waits for staging, the write, the
  checksums and the commit;
- asynchronous (the default): the step waits for the previous save (finished here: the
  benchmark lets each write complete, as a checkpoint interval longer than a write does) and
  for staging the state into host buffers kept from the last save; the write runs in a
  background thread. The first asynchronous save also allocates those buffers and is reported
  apart from the steady state.

Each side saves `--saves` times into its own run directory under `--dir` (default: a temporary
directory on the system disk); the medians are compared (target: async <= 10% of sync). The
load average is printed with the result because the background write and other jobs share the
cores. Last line: one JSON object.

    python benchmarks/checkpoint_stall.py                  # small preset, 3 saves per side
    python benchmarks/checkpoint_stall.py --preset tiny --saves 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine, print_json

from slipstream.model import Transformer
from slipstream.model.presets import get_preset
from slipstream.perf.flops import num_params
from slipstream.train.checkpoint import CheckpointManager
from slipstream.train.config import OptimizerConfig
from slipstream.train.optim import build_optimizer


def build_state(preset: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    """The preset's model (seeded init) and AdamW after one step, so the moments exist."""
    config = get_preset(preset).config.replace(dtype="float32")
    model = Transformer(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    optimizer = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, config


def measure(run_dir: Path, model, optimizer, config, *, async_save: bool, saves: int) -> dict:
    """Blocking seconds of each save, and (async) the background write's seconds."""
    manager = CheckpointManager(run_dir, rank=0, world_size=1, process_group=None, keep_last=1,
                                async_save=async_save)
    train_state = {"step": 0}
    blocking, writes, num_bytes = [], [], 0
    for step in range(1, saves + 1):
        blocking.append(manager.save(step, model, optimizer, train_state | {"step": step},
                                     {"benchmark": True}, config))
        manager.wait()
        (result,) = manager.completed()
        writes.append(result.write_s)
        num_bytes = result.num_bytes
        print(f"  {'async' if async_save else 'sync '} save {step}: step blocked {blocking[-1]:.3f}s, "
              f"write {result.write_s:.2f}s")
    manager.close()
    return {"blocking_s": blocking, "write_s": writes, "bytes": num_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()

    model, optimizer, config = build_state(args.preset)
    print(f"{args.preset}: {num_params(config) / 1e6:.0f}M parameters with AdamW state; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sync = measure(Path(tmp) / "sync", model, optimizer, config, async_save=False, saves=args.saves)
        async_ = measure(Path(tmp) / "async", model, optimizer, config, async_save=True, saves=args.saves)
    sync_s = statistics.median(sync["blocking_s"])
    steady = async_["blocking_s"][1:] or async_["blocking_s"]
    async_s = statistics.median(steady)
    ratio = async_s / sync_s
    print(f"checkpoint of {sync['bytes'] / 1e9:.2f} GB: synchronous save blocks the step {sync_s:.2f}s; "
          f"asynchronous {async_s:.3f}s ({100 * ratio:.1f}% of synchronous; target <= 10%), first "
          f"asynchronous save {async_['blocking_s'][0]:.3f}s (allocates the staging buffers); "
          f"background write {statistics.median(async_['write_s']):.2f}s")
    print_json({
        "benchmark": "checkpoint_stall", "preset": args.preset, "num_params": num_params(config),
        "checkpoint_bytes": sync["bytes"], "saves": args.saves,
        "sync_blocking_s": sync_s, "async_blocking_s": async_s, "async_to_sync": ratio,
        "async_first_blocking_s": async_["blocking_s"][0],
        "async_write_s": statistics.median(async_["write_s"]),
        "sync_blocking_all_s": sync["blocking_s"], "async_blocking_all_s": async_["blocking_s"],
        "target_met": ratio <= 0.10, "loadavg_1m": os.getloadavg()[0], "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })


if __name__ == "__main__":
    main()
