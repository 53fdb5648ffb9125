"""Pipeline parallelism: a 2-stage 1F1B pipeline against FSDP2 on the same 2 ranks and one process.

The `tiny` preset (6 layers, ~16M parameters, untied embeddings) trains on the standard-library
corpus, a global batch of 8 sequences of 256 tokens in micro-batches of 2, fp32, with
`slipstream train` as a user runs it:

- one process: 4 accumulation micro-batches per step;
- FSDP2 on 2 ranks (`--nproc 2`): 2 replicas, 2 micro-batches each;
- PP = 2, 1F1B (`--nproc 2 --parallel.pipeline_parallel_degree=2`): one replica whose 4
  micro-batches are the pipeline's, 3 layers and the embedding on rank 0, 3 layers, the final
  norm and the output layer on rank 1.

Each layout runs `--repeats` times, in turns; a run's step time is the median of its steps after
`--warmup`, and a layout's the median over its runs. Next to each: tokens/s, MFU (the trainer's,
over every rank's calibrated peak) and the perf model's predicted step (`slipstream perf train
--hardware cpu`, the functions behind it, default efficiencies) with the measured / predicted
ratio. Last line: one JSON object.

    python benchmarks/train_pipeline.py                 # 2 repeats of 2 warm-up + 4 timed steps
    python benchmarks/train_pipeline.py --repeats 3 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, median, print_json
from train_throughput import prepared_data

PRESET = "tiny"
SEQ_LEN = 256
GLOBAL_BATCH, MICRO_BATCH = 8, 2
LAYOUTS = {
    "one process": (1, [], ["--zero", "0"]),
    "FSDP2, 2 ranks": (2, [], ["--zero", "3"]),
    "PP=2 1F1B": (2, ["--parallel.pipeline_parallel_degree=2"], ["--pp", "2", "--zero", "0"]),
}
"""Name: (ranks, trainer overrides, `perf train` layout flags)."""


def run_layout(name: str, data_dir: Path, work_dir: Path, warmup: int, steps: int) -> dict:
    """One `slipstream train` run of the layout; its median step after the warm-up, and its MFU."""
    from slipstream.train.config import load_config

    nproc, overrides, _ = LAYOUTS[name]
    run_dir = work_dir / name.replace(" ", "-").replace(",", "").replace("=", "")
    config = load_config(None, [
        f"--model.preset={PRESET}", f"--data.path={data_dir}", f"--run.dir={run_dir}",
        f"--data.seq_len={SEQ_LEN}", f"--training.global_batch_size={GLOBAL_BATCH}",
        f"--training.micro_batch_size={MICRO_BATCH}", f"--training.steps={warmup + steps}",
        "--schedule.warmup_steps=0", "--eval.interval=0", "--checkpoint.save_final=false",
        "--logging.tensorboard=false", "--logging.interval=1000000", *overrides,
    ])
    toml = run_dir.with_suffix(".toml")
    toml.parent.mkdir(parents=True, exist_ok=True)
    toml.write_text(config.to_toml())
    command = [sys.executable, "-m", "slipstream.cli", "train", "--config", str(toml)]
    command += ["--nproc", str(nproc)] if nproc > 1 else []
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if result.returncode:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > warmup]
    return {"step_s": median([r["step_s"] for r in timed]), "mfu": median([r["mfu"] for r in timed]),
            "loss": timed[-1]["loss"]}


def predicted_step_s(name: str) -> float:
    """`slipstream perf train`'s step time for the layout on this CPU, default efficiencies."""
    from slipstream.cli import build_parser
    from slipstream.perf import commands

    nproc, _, layout_flags = LAYOUTS[name]
    args = build_parser().parse_args([
        "perf", "train", "--model", PRESET, "--hardware", "cpu", "--dtype", "fp32",
        "--devices", str(nproc), "--seq-len", str(SEQ_LEN), "--global-batch", str(GLOBAL_BATCH),
        "--micro-batch", str(MICRO_BATCH), *layout_flags,
    ])
    return commands.train(args)[1]["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from slipstream.model.presets import get_preset

    data_dir = prepared_data(get_preset(PRESET).config.vocab_size)
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    print(f"{PRESET}, batch {GLOBAL_BATCH} x {SEQ_LEN} tokens in micro-batches of {MICRO_BATCH}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} runs per layout in turns, "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-pp-") as tmp:
        for repeat in range(args.repeats):
            for name in LAYOUTS:
                work_dir = Path(tmp) / f"r{repeat}"
                runs[name].append(run_layout(name, data_dir, work_dir, args.warmup, args.steps))
    results = {}
    baseline_s = median([r["step_s"] for r in runs["FSDP2, 2 ranks"]])
    for name, layout_runs in runs.items():
        step_s = median([r["step_s"] for r in layout_runs])
        predicted_s = predicted_step_s(name)
        results[name] = {
            "ranks": LAYOUTS[name][0], "step_s": step_s, "step_s_runs": [r["step_s"] for r in layout_runs],
            "tokens_per_s": tokens_per_step / step_s, "mfu": median([r["mfu"] for r in layout_runs]),
            "final_loss": layout_runs[-1]["loss"], "predicted_step_s": predicted_s,
            "measured_over_predicted": step_s / predicted_s, "step_over_fsdp2": step_s / baseline_s,
        }
        r = results[name]
        print(f"{name:>15}: step {step_s:6.3f} s ({r['tokens_per_s']:7,.0f} tok/s, "
              f"MFU {100 * r['mfu']:4.1f}%, x{r['step_over_fsdp2']:.2f} of FSDP2)  perf model "
              f"{predicted_s:6.3f} s, measured/predicted {r['measured_over_predicted']:.2f}, "
              f"last loss {r['final_loss']:.4f}", flush=True)
    print_json({"benchmark": "train_pipeline", "preset": PRESET, "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH,
                "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
                "machine": machine(), "load_average": os.getloadavg()[0], "results": results})


if __name__ == "__main__":
    main()
