"""Training throughput: slipstream's trainer against a plain PyTorch loop over transformers.

For each preset (default: `tiny` ~16M and `small` ~125M) and dtype (fp32, and bf16 autocast),
both sides train the same initial weights on the standard-library corpus, batch 8 x 256 tokens,
AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1) with gradient clipping at 1.0:

- plain: `transformers.LlamaForCausalLM(...)(input_ids, labels=...)`, `loss.backward()`,
  `clip_grad_norm_`, `torch.optim.AdamW` with its defaults (what a plain script does);
- slipstream: `Trainer.train_step()` with the default config (oneDNN linears on CPU, fused AdamW,
  the allocator kept warm), its metrics records collected.

Each measurement runs in a fresh process (so one side's allocator or thread settings cannot
help the other), alternating sides. After warm-up steps, tokens/s = timed tokens / wall time;
MFU = tokens/s x `train_flops_per_token` / the calibrated peak of the dtype (best GEMM path).
The trainer's own per-step MFU (mean over the timed steps) is printed next to the benchmark's
count. Last line: one JSON object.

    python benchmarks/train_throughput.py                     # tiny and small, fp32 and bf16
    python benchmarks/train_throughput.py --presets tiny --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine, print_json

BATCH_SIZE = 8
SEQ_LEN = 256
LR, BETAS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, (0.9, 0.95), 0.1, 1.0
DATA_ROOT = Path(__file__).resolve().parent.parent / "runs" / "bench"  # wherever it is run from


def prepared_data(vocab_size: int) -> Path:
    from slipstream.model.create import stdlib_tokenizer
    from slipstream.train.data import corpus_documents, prepare_dataset

    out = DATA_ROOT / f"data-stdlib-{vocab_size}"
    prepare_dataset(out, stdlib_tokenizer(vocab_size), corpus_documents(["stdlib"]), progress=False)
    return out


def train_config(preset: str, dtype: str, data_dir: Path, run_dir: Path, steps: int):
    from slipstream.train.config import load_config

    return load_config(None, [
        f"--model.preset={preset}", f"--data.path={data_dir}", f"--run.dir={run_dir}",
        f"--data.seq_len={SEQ_LEN}", f"--training.global_batch_size={BATCH_SIZE}",
        f"--training.micro_batch_size={BATCH_SIZE}", f"--training.steps={steps}",
        f"--training.dtype={dtype}", f"--training.max_grad_norm={MAX_GRAD_NORM}",
        f"--optimizer.lr={LR}", f"--optimizer.betas={list(BETAS)}",
        f"--optimizer.weight_decay={WEIGHT_DECAY}", "--schedule.warmup_steps=0",
        "--schedule.decay=constant", "--eval.interval=0", "--checkpoint.save_final=false",
        "--logging.tensorboard=false", "--logging.interval=1000000",
    ])


def worker_slipstream(preset: str, dtype: str, warmup: int, steps: int) -> dict:
    from slipstream.train.trainer import Trainer

    data_dir = prepared_data(_vocab_size(preset))
    run_dir = Path(tempfile.mkdtemp(prefix="slipstream-bench-"))
    try:
        trainer = Trainer(train_config(preset, dtype, data_dir, run_dir, warmup + steps))
        losses = [trainer.train_step()["loss"] for _ in range(warmup)]
        start = time.perf_counter()
        records = [trainer.train_step() for _ in range(steps)]
        elapsed_s = time.perf_counter() - start
        trainer.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "elapsed_s": elapsed_s, "num_tokens": steps * BATCH_SIZE * SEQ_LEN,
        "first_loss": losses[0] if losses else records[0]["loss"],
        "step_mfu_mean": sum(r["mfu"] for r in records) / steps,
        "peak_flops_per_s": trainer.peak_flops_per_s,
        "time_split_s": {k: sum(r[k] for r in records) / steps
                         for k in ("data_wait_s", "forward_backward_s", "optimizer_s", "step_s")},
    }


def worker_plain(preset: str, dtype: str, warmup: int, steps: int) -> dict:
    import transformers

    from slipstream.model.presets import get_preset
    from slipstream.train.data import TokenDataset, WindowLoader
    from slipstream.train.trainer import initial_state

    data_dir = prepared_data(_vocab_size(preset))
    config = get_preset(preset).config
    hf_config = transformers.LlamaConfig(**{
        k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "dtype", "torch_dtype")
    })
    model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(initial_state(train_config(preset, dtype, data_dir, Path("unused"), 1), config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    loader = WindowLoader(TokenDataset(data_dir).tokens("train"), seq_len=SEQ_LEN,
                          batch_size=BATCH_SIZE, prefetch=0)
    windows = [torch.cat([b.inputs, b.targets[:, -1:]], dim=1) for b in
               (next(loader) for _ in range(warmup + steps))]  # (B, T + 1): the same windows

    def step(window: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(input_ids=window, labels=window).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(w) for w in windows[:warmup]]
    start = time.perf_counter()
    for window in windows[warmup:]:
        step(window)
    return {"elapsed_s": time.perf_counter() - start, "num_tokens": steps * BATCH_SIZE * SEQ_LEN,
            "first_loss": losses[0] if losses else None}


def _vocab_size(preset: str) -> int:
    from slipstream.model.presets import get_preset

    return get_preset(preset).config.vocab_size


def run_worker(side: str, preset: str, dtype: str, warmup: int, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", side, "--presets", preset, "--dtypes", dtype,
               "--warmup", str(warmup), "--steps", str(steps)]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if result.returncode:
        raise RuntimeError(f"{side} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", choices=["plain", "slipstream"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        fn = worker_plain if args.worker == "plain" else worker_slipstream
        print(json.dumps(fn(args.presets, args.dtypes, args.warmup, args.steps)))
        return

    from slipstream.model.presets import get_preset
    from slipstream.perf.flops import mfu, train_flops_per_token
    from slipstream.perf.hardware import calibrate

    calibration = calibrate()
    results = {}
    print(f"batch {BATCH_SIZE} x {SEQ_LEN} tokens, {args.warmup} warm-up + {args.steps} timed steps, "
          f"load average {os.getloadavg()[0]:.2f}")
    for preset in args.presets.split(","):
        flops_per_token = train_flops_per_token(get_preset(preset).config, SEQ_LEN)
        for dtype in args.dtypes.split(","):
            peak = calibration.peak_flops(dtype)
            plain = run_worker("plain", preset, dtype, args.warmup, args.steps)
            ours = run_worker("slipstream", preset, dtype, args.warmup, args.steps)
            row = {}
            for name, r in (("plain", plain), ("slipstream", ours)):
                tokens_per_s = r["num_tokens"] / r["elapsed_s"]
                row[f"{name}_tokens_per_s"] = tokens_per_s
                row[f"{name}_mfu"] = mfu(tokens_per_s, flops_per_token, peak)
                row[f"{name}_first_loss"] = r["first_loss"]
            row["ratio"] = row["slipstream_tokens_per_s"] / row["plain_tokens_per_s"]
            row["trainer_step_mfu"] = ours["step_mfu_mean"]
            row["mfu_difference"] = ours["step_mfu_mean"] / row["slipstream_mfu"] - 1
            row["slipstream_time_split_s"] = ours["time_split_s"]
            row["peak_flops_per_s"] = peak
            results[f"{preset}/{dtype}"] = row
            print(
                f"{preset:>6} {dtype:>9}: plain {row['plain_tokens_per_s']:8,.0f} tok/s "
                f"(MFU {100 * row['plain_mfu']:4.1f}%)  slipstream {row['slipstream_tokens_per_s']:8,.0f} "
                f"tok/s (MFU {100 * row['slipstream_mfu']:4.1f}%, per-step records "
                f"{100 * row['trainer_step_mfu']:4.1f}%)  ratio {row['ratio']:.2f}x", flush=True,
            )
    print_json({"benchmark": "train_throughput", "batch_size": BATCH_SIZE, "seq_len": SEQ_LEN,
                "warmup_steps": args.warmup, "timed_steps": args.steps, "machine": machine(),
                "load_average": os.getloadavg()[0], "results": results})


if __name__ == "__main__":
    main()
