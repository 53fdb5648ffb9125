"""The main job on the embedded defaults: prepare the corpus, train, export, serve, report.

1. Tokenizes the Python standard library's sources (the embedded corpus) with a BPE trained on
   them into `WORKDIR/data` (reused when already there), holding 1% of the files out.
2. Trains the `tiny` preset (~16M parameters) from scratch with slipstream's trainer: batch
   8 x 256 tokens, AdamW with warm-up and cosine decay, evaluating on the held-out files as it
   goes (a few minutes on a 2-core CPU), into `WORKDIR/run`; under bf16 autocast where the device
   multiplies bf16 (`perf.hardware.multiplies_bf16`), else in fp32.
3. Exports the last checkpoint as a Hugging Face model directory, `WORKDIR/model`.
4. Generates greedy completions of a few Python prompts with the serving engine (`slipstream.LLM`).
5. Reports the held-out loss curve against a uniform guess (ln vocab), tokens/s, MFU against the
   calibrated peak, and where the time went.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from slipstream.model.create import stdlib_tokenizer
from slipstream.model.presets import get_preset
from slipstream.perf.flops import num_params
from slipstream.perf.goodput import read_events
from slipstream.perf.goodput import summarize as summarize_goodput
from slipstream.perf.hardware import multiplies_bf16
from slipstream.perf.records import METRICS_FILE
from slipstream.train.config import load_config
from slipstream.train.data import corpus_documents, prepare_dataset
from slipstream.train.export import export_run
from slipstream.train.job import device_type_of
from slipstream.train.trainer import Trainer

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 600
BATCH_SIZE = 8
SEQ_LEN = 256
PROMPTS = (
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.",
    "    def __repr__(self):\n        return",
    "        if not isinstance(value, str):\n            raise",
)
MAX_TOKENS = 40


def run_demo(
    workdir: str | Path,
    *,
    preset: str = "tiny",
    max_steps: int = DEFAULT_STEPS,
    max_documents: int | None = None,
    dtype: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Run the job and return a flat report (also what the CLI prints as its JSON line).

    `max_documents` trains on an evenly spread subset of the corpus (for quick checks). `dtype`
    "auto" is bfloat16 where the training device multiplies bf16, else float32.
    """
    start = time.perf_counter()
    if dtype == "auto":
        dtype = "bfloat16" if multiplies_bf16(device_type_of("auto")) else "float32"
    workdir = Path(workdir)
    spec = get_preset(preset)
    if spec.config_only:  # found before the data is prepared, not after
        raise ValueError(f"preset {preset!r} is a planning shape too large to train here")
    if max_steps < 1 or (max_documents is not None and max_documents < 2):
        raise ValueError(f"max_steps must be >= 1 and max_documents >= 2, got {max_steps}, {max_documents}")
    vocab_size = spec.config.vocab_size
    documents = corpus_documents(["stdlib"])
    if max_documents is not None:
        documents = documents[:: max(len(documents) // max_documents, 1)][:max_documents]
    meta = prepare_dataset(workdir / "data", stdlib_tokenizer(vocab_size), documents, progress=progress)
    prepared = time.perf_counter()
    run_dir = workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    trainer = Trainer(demo_config(workdir / "data", run_dir, preset, max_steps, dtype))
    started = time.perf_counter()
    if trainer.val_loader is not None:
        trainer.metrics.log(trainer.evaluate())  # the loss before training: about ln(vocab)
    with tqdm(total=max_steps, desc="training", unit="step", disable=not progress) as bar:
        trainer.hooks.append(lambda _, r: (bar.update(), bar.set_postfix(
            loss=f"{r['loss']:.3f}", tok_s=f"{r['tokens_per_s']:,.0f}")))
        trainer.run()
    trained = time.perf_counter()
    export_run(run_dir, workdir / "model", overwrite=True)
    exported = time.perf_counter()
    completions = generate(workdir / "model")
    done = time.perf_counter()
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    goodput = summarize_goodput(read_events(run_dir))
    report = summarize(records) | {
        "goodput": goodput["goodput"],
        "goodput_seconds": goodput["seconds"],
        "preset": preset,
        "num_params": num_params(trainer.model_config),
        "data_dir": str(workdir / "data"),
        "train_tokens_available": meta["splits"]["train"]["num_tokens"],
        "heldout_tokens": meta["splits"]["val"]["num_tokens"],
        "run_dir": str(run_dir),
        "model_dir": str(workdir / "model"),
        "completions": completions,
        "prepare_s": prepared - start,
        "startup_s": started - prepared,
        "training_s": trained - started,
        "export_s": exported - trained,
        "generate_s": done - exported,
        "total_s": done - start,
    }
    return report


def demo_config(data_dir: Path, run_dir: Path, preset: str, steps: int, dtype: str):
    return load_config(None, [
        f"--model.preset={preset}", f"--data.path={data_dir}", f"--run.dir={run_dir}",
        f"--data.seq_len={SEQ_LEN}", f"--training.global_batch_size={BATCH_SIZE}",
        f"--training.micro_batch_size={BATCH_SIZE}", f"--training.steps={steps}",
        f"--training.dtype={dtype}", "--optimizer.lr=2e-3", "--optimizer.weight_decay=0.1",
        f"--schedule.warmup_steps={max(steps // 10, 1)}", "--schedule.min_lr_ratio=0.1",
        f"--eval.interval={max(steps // 6, 1)}", "--eval.num_batches=4",
        f"--checkpoint.interval={max(steps // 2, 1)}", "--checkpoint.keep_last=1",
        "--logging.tensorboard=false",
    ])


def generate(model_dir: Path) -> list[dict[str, str]]:
    """Greedy completions of `PROMPTS` by the serving engine."""
    from slipstream import LLM, SamplingParams

    llm = LLM(str(model_dir))
    outputs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    return [{"prompt": p, "completion": o.outputs[0].text} for p, o in zip(PROMPTS, outputs, strict=True)]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Loss curve, throughput, MFU and the time split from a run's metrics records."""
    (run,) = [r for r in records if r["kind"] == "run"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    steady = train[min(2, len(train) - 1):]  # the first steps pay for first-touch allocations
    best = min(evals, key=lambda r: r["eval_loss"]) if evals else None
    tail = train[-max(len(train) // 10, 1):]
    return {
        "steps": len(train),
        "batch_size": run["global_batch_size"],
        "seq_len": run["seq_len"],
        "dtype": run["dtype"],
        "vocab_size": run["vocab_size"],
        "uniform_loss": math.log(run["vocab_size"]),
        "tokens_trained": train[-1]["tokens_seen"],
        "first_train_loss": train[0]["loss"],
        "last_train_loss": statistics.mean(r["loss"] for r in tail),
        "first_eval_loss": evals[0]["eval_loss"] if evals else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_eval_step": best["step"] if best else None,
        "eval_curve": [[r["step"], r["eval_loss"]] for r in evals],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "peak_flops_per_s": run["peak_flops_per_s"],
        "peak_source": run["peak_source"],
        "steps_s": sum(r["step_s"] for r in train),
        "data_wait_s": sum(r["data_wait_s"] for r in train),
        "forward_backward_s": sum(r["forward_backward_s"] for r in train),
        "optimizer_s": sum(r["optimizer_s"] for r in train),
        "eval_s": sum(r["eval_s"] for r in evals),
        "checkpoint_s": sum(r["checkpoint_s"] for r in records if r["kind"] == "checkpoint"),
        "peak_memory_bytes": train[-1]["peak_memory_bytes"],
    }


def format_report(report: dict[str, Any]) -> str:
    r = report
    lines = [
        f"data: the standard library's sources, {r['train_tokens_available']:,} training tokens, "
        f"{r['heldout_tokens']:,} held out ({r['data_dir']})",
        f"model: {r['preset']} preset, {r['num_params'] / 1e6:.1f}M parameters, vocab {r['vocab_size']}; "
        f"{r['steps']} steps of {r['batch_size']} x {r['seq_len']} tokens ({r['tokens_trained']:,} "
        f"tokens) in {r['dtype']}",
    ]
    if r["first_eval_loss"] is not None:
        curve = ", ".join(f"{loss:.2f}" for _, loss in r["eval_curve"])
        lines.append(
            f"held-out loss: {r['first_eval_loss']:.3f} before training -> {r['last_eval_loss']:.3f} "
            f"(best {r['best_eval_loss']:.3f} at step {r['best_eval_step']}); a uniform guess is "
            f"ln {r['vocab_size']} = {r['uniform_loss']:.3f}; curve: {curve}"
        )
    lines.append(
        f"train loss: {r['first_train_loss']:.3f} at step 1 -> {r['last_train_loss']:.3f} "
        f"(mean of the last tenth of the steps)"
    )
    lines.append(
        f"throughput: {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% of "
        f"{r['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s ({r['peak_source']}); peak memory "
        f"{r['peak_memory_bytes'] / 2**30:.2f} GiB"
    )
    total = r["total_s"]
    parts = {
        "forward+backward": r["forward_backward_s"], "optimizer": r["optimizer_s"],
        "data wait": r["data_wait_s"], "other step work": r["steps_s"] - r["forward_backward_s"]
        - r["optimizer_s"] - r["data_wait_s"], "eval": r["eval_s"], "checkpoint": r["checkpoint_s"],
        "data prepare": r["prepare_s"], "start-up": r["startup_s"], "export": r["export_s"],
        "generate": r["generate_s"],
    }
    other = total - sum(parts.values())
    split = ", ".join(f"{name} {s:.1f}s ({100 * s / total:.1f}%)" for name, s in parts.items())
    lines.append(f"time: {total:.0f}s in all: {split}, other {other:.1f}s")
    losses = ", ".join(f"{name} {s:.1f}s" for name, s in r["goodput_seconds"].items()
                       if name != "productive" and s >= 0.05)
    lines.append(f"training goodput (slipstream goodput {r['run_dir']}): {100 * r['goodput']:.1f}% "
                 f"of the run's wall time was productive steps; the rest: {losses}")
    lines.append(f"exported to {r['model_dir']}; greedy completions from slipstream.LLM:")
    for c in r["completions"]:
        lines.append(f"  {c['prompt']!r} -> {c['completion']!r}")
    return "\n".join(lines)
