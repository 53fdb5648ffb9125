"""The main job on the embedded defaults: create a model, run it over the corpus, report.

Creates a randomly initialised preset model (with a tokenizer trained on the standard library)
in a work directory, runs batched forward passes over windows of the standard library's source
in fp32 and bf16, and reports the loss against a uniform guess, throughput, achieved FLOP/s and
MFU against this machine's calibrated peak. Training and serving will extend this job.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.corpus import read_documents, stdlib_files
from slipstream.model import load_model
from slipstream.model.create import create_model_dir
from slipstream.model.tokenizer import Tokenizer
from slipstream.perf.flops import forward_flops_per_token, mfu, num_params
from slipstream.perf.hardware import calibrate

logger = logging.getLogger(__name__)

BATCH_SIZE = 8
SEQ_LEN = 256
NUM_REPEATS = 5


def run_demo(workdir: str | Path, *, preset: str = "tiny") -> dict[str, Any]:
    """Run the job and return a flat report (also what the CLI prints as its JSON line)."""
    model_dir = Path(workdir) / "model"
    if not (model_dir / "config.json").is_file():
        create_model_dir(preset, model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    token_ids = corpus_windows(tokenizer, BATCH_SIZE, SEQ_LEN)
    calibration = calibrate()
    report: dict[str, Any] = {"model_dir": str(model_dir), "preset": preset}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_dir, dtype=dtype)
        stats = measure_forward(model, token_ids)
        name = str(dtype).removeprefix("torch.")
        peak = calibration.peak_flops(name)
        report |= {f"{name}_{key}": value for key, value in stats.items()}
        report[f"{name}_mfu"] = mfu(stats["tokens_per_s"], stats["flops_per_token"], peak)
        report[f"{name}_peak_flops_per_s"] = peak
    config = model.config
    report |= {
        "num_params": num_params(config),
        "vocab_size": config.vocab_size,
        "uniform_loss": math.log(config.vocab_size),
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
    }
    return report


def corpus_windows(tokenizer: Tokenizer, batch_size: int, seq_len: int) -> torch.Tensor:
    """(batch_size, seq_len) token ids: consecutive windows from the end of the stdlib corpus,
    documents joined by the end-of-text token."""
    needed = batch_size * seq_len
    ids: list[int] = []
    for text in read_documents(reversed(stdlib_files())):
        ids += tokenizer.encode(text) + [tokenizer.eos_token_id]
        if len(ids) >= needed:
            break
    return torch.tensor(ids[:needed]).view(batch_size, seq_len)


@torch.inference_mode()
def measure_forward(model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, float]:
    """Median time of repeated forward passes, the next-token loss, and what that implies."""
    batch_size, seq_len = token_ids.shape
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    logits = model(token_ids, positions)  # warm-up
    times_s = []
    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        logits = model(token_ids, positions)
        times_s.append(time.perf_counter() - start)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), token_ids[:, 1:].flatten())
    forward_s = statistics.median(times_s)
    flops_per_token = forward_flops_per_token(model.config, seq_len, causal=True)
    tokens_per_s = token_ids.numel() / forward_s
    return {
        "loss": loss.item(),
        "forward_s": forward_s,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "achieved_flops_per_s": tokens_per_s * flops_per_token,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"model: {report['preset']} preset, {report['num_params'] / 1e6:.1f}M parameters, "
        f"vocab {report['vocab_size']} ({report['model_dir']})",
        f"forward passes over {report['batch_size']} x {report['seq_len']} tokens of the stdlib "
        f"(median of {NUM_REPEATS}):",
    ]
    for name in ("float32", "bfloat16"):
        lines.append(
            f"  {name:>8}: loss {report[f'{name}_loss']:.3f} (uniform guess "
            f"{report['uniform_loss']:.3f}), {report[f'{name}_tokens_per_s']:,.0f} tokens/s, "
            f"{report[f'{name}_achieved_flops_per_s'] / 1e9:.0f} GFLOP/s = "
            f"{100 * report[f'{name}_mfu']:.0f}% MFU of the calibrated "
            f"{report[f'{name}_peak_flops_per_s'] / 1e9:.0f} GFLOP/s"
        )
    return "\n".join(lines)
