"""Local validation of the performance model: calibrate from one run, predict others, measure.

Serving (slipstream's engine, fp32, the CPU fast path):
- calibration run: the `small` preset; prefill steps of 1 x 128 and 1 x 1536 tokens, decode steps
  at batch 1, 8 and 32 (context about 256): engine step records (`kind: "engine_step"`), fitted
  with `slipstream.perf.measured.fit_engine_steps` (GEMM and memory multipliers, the roofline
  overlap and the attention fraction; per-kernel and per-step overheads stay at their priors,
  which one model's steps cannot separate from weight streaming);
- predicted, then measured: `tiny` and `medium` at the same points (decode ms/token at batch 1, 8,
  32; prefill of 512 tokens), and `small` at batch 16 and a 1024-token prefill.
  Every model is measured in each of --rounds rounds (3), in turn; each point is the median of
  its steps in the least disturbed round (`summarize`),
  because the memory bandwidth a process gets here drifts from minute to minute.
Training (slipstream's trainer, fp32, batch 8 x 256 on the stdlib corpus):
- calibration run: `tiny`; its metrics.jsonl and config.toml fit the GEMM multiplier;
- predicted, then measured: `tiny` at batch 16 and `small` at batch 8.
The baseline is the same prediction without calibration (calibrated peaks only); both errors are
printed, and the ratio of mean errors. Each training run is its own process. Run it on an idle
machine (it refuses when the 1-minute load average is >= 0.5, unless --force). Last line: JSON.

    python benchmarks/perf_local_validation.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path("runs/perf-local")
DECODE_BATCHES = (1, 8, 32)
CALIBRATION_PREFILLS = (128, 1536)
"""A short and a long prompt: attention's share differs enough between them to fit its rate."""
PROMPT_LEN, DECODE_STEPS = 256, 16


def check_quiet(limit: float) -> None:
    """Stop when others load the machine: this process's own threads plus a margin is allowed."""
    load = float(Path("/proc/loadavg").read_text().split()[0])
    if load > limit:
        raise SystemExit(f"load average {load} > {limit} mid-run: another job is measuring; rerun "
                         "on an idle machine (numbers taken under contention are not kept)")


def engine_records(model_dir: Path, batches, prefill_lens) -> tuple[list[dict], int]:
    """Engine step records: one prefill per length (batch 1), decode steps per batch size; and
    the largest decode batch the engine ran as its CPU decode graph (0: none)."""
    import torch

    check_quiet(torch.get_num_threads() + 0.75)

    from slipstream.serve.engine import Engine, EngineConfig
    from slipstream.serve.request import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(batches) + 1,
                                 max_num_batched_tokens=max(max(batches) * PROMPT_LEN, max(prefill_lens)),
                                 enable_prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    records, ids = [], iter(range(10**9))

    def add(n: int, length: int, max_tokens: int) -> None:
        for _ in range(n):
            prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
            engine.add_request(f"r{next(ids)}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    add(1, 64, 2)  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    for length in prefill_lens:
        for _ in range(3):
            add(1, length, 1)
            records.append({"kind": "engine_step", "phase": "prefill", "batch_size": 1,
                            "prompt_len": length, "step_s": timed_step()})
            while engine.has_unfinished_requests():
                engine.step()
    for batch in batches:
        add(batch, PROMPT_LEN, DECODE_STEPS + 1)
        timed_step()  # the batch's prefill
        for j in range(DECODE_STEPS):
            records.append({"kind": "engine_step", "phase": "decode", "batch_size": batch,
                            "context_len": PROMPT_LEN + j, "step_s": timed_step()})
        while engine.has_unfinished_requests():
            engine.step()
    graph = engine.runner.decode_graph
    return records, 0 if graph is None else graph.max_seqs


def summarize(records: list[dict]) -> list[dict]:
    """Step time per (phase, batch): the median of each round's steps, then the fastest round
    (decode context at the middle of its steps). Within a round the median drops stray slow
    steps; across rounds the noise is one-sided (another tenant's load, a slow minute of memory
    bandwidth only ever slow a round down), so the least disturbed round is the steadiest
    statistic, and calibration and targets are summarised alike."""
    groups: dict[tuple, dict[int, list[float]]] = {}
    for r in records:
        key = (r["phase"], r["batch_size"], r.get("prompt_len"))
        groups.setdefault(key, {}).setdefault(r.get("round", 0), []).append(r["step_s"])
    out = []
    for (phase, batch, prompt), rounds in groups.items():
        step_s = min(statistics.median(times) for times in rounds.values())
        length = prompt if phase == "prefill" else PROMPT_LEN + DECODE_STEPS // 2
        key = "prompt_len" if phase == "prefill" else "context_len"
        out.append({"kind": "engine_step", "phase": phase, "batch_size": batch, key: length,
                    "step_s": step_s})
    return out


def train_worker(preset: str, batch: int, steps: int) -> None:
    """One training run (own process); prints its run directory."""
    from train_throughput import prepared_data

    from slipstream.train.config import load_config
    from slipstream.train.trainer import Trainer

    data = prepared_data(8192)
    run_dir = RUNS / f"train-{preset}-b{batch}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    config = load_config(None, [f"--model.preset={preset}", f"--data.path={data}", f"--run.dir={run_dir}",
                                "--data.seq_len=256", f"--training.global_batch_size={batch}",
                                f"--training.micro_batch_size={batch}", f"--training.steps={steps}",
                                "--training.dtype=float32", "--eval.interval=0",
                                "--checkpoint.save_final=false", "--logging.tensorboard=false"])
    Trainer(config).run()
    print(json.dumps({"run_dir": str(run_dir)}))


def run_training(preset: str, batch: int, steps: int) -> Path:
    import torch

    check_quiet(torch.get_num_threads() + 0.75)
    out = subprocess.run([sys.executable, __file__, "--train-worker", preset, str(batch), str(steps)],
                         capture_output=True, text=True, check=True, cwd=Path.cwd())
    return Path(json.loads(out.stdout.strip().splitlines()[-1])["run_dir"])


def compare(label: str, measured_s: float, calibrated_s: float, baseline_s: float) -> dict:
    row = {"point": label, "measured_s": measured_s, "predicted_s": calibrated_s,
           "error": calibrated_s / measured_s - 1, "uncalibrated_s": baseline_s,
           "uncalibrated_error": baseline_s / measured_s - 1}
    print(f"{label:<34}{1e3 * measured_s:>11.2f}{1e3 * calibrated_s:>11.2f}{100 * row['error']:>+8.1f}%"
          f"{1e3 * baseline_s:>12.2f}{100 * row['uncalibrated_error']:>+8.1f}%")
    return row


def serving_part(acc, base_eff, rounds: int) -> list[dict]:
    from common import ensure_model  # noqa: F401  (benchmarks/ on the path)

    from slipstream.model.create import create_model_dir
    from slipstream.perf.measured import engine_step_work, fit_engine_steps
    from slipstream.perf.records import read_engine_steps
    from slipstream.perf.serving import ServeSetup
    from slipstream.perf.shapes import resolve_model

    def model_dir(preset: str) -> Path:
        path = RUNS / f"model-{preset}"
        if not (path / "config.json").is_file():
            create_model_dir(preset, path, dtype="float32", overwrite=True)
        return path

    # The memory bandwidth this machine gives a process drifts between minutes (40-88 GB/s), so
    # every model is measured in each of `rounds` rounds, in turn (see `summarize`).
    targets = [("tiny", DECODE_BATCHES, (512,)), ("medium", DECODE_BATCHES, (512,)),
               ("small", (16,), (1024,))]
    calib_records: list[dict] = []
    target_records: dict[str, list[dict]] = {preset: [] for preset, _, _ in targets}
    graph_batches: dict[str, int] = {}  # per preset: the engine's decode-graph limit
    for i in range(rounds):
        records, graph_batches["small"] = engine_records(model_dir("small"), DECODE_BATCHES,
                                                         CALIBRATION_PREFILLS)
        calib_records += [r | {"round": i} for r in records]
        for preset, batches, prefills in targets:
            records, graph_batches[preset] = engine_records(model_dir(preset), batches, prefills)
            target_records[preset] += [r | {"round": i} for r in records]

    def write(name: str, records: list[dict]) -> None:
        (RUNS / name).write_text("".join(json.dumps(r) + "\n" for r in records))

    write("engine-small.jsonl", calib_records)
    for preset, records in target_records.items():
        write(f"engine-{preset}-targets.jsonl", records)
    steps = read_engine_steps(summarize(calib_records))
    cal = fit_engine_steps(steps, ServeSetup(shape=resolve_model("small"), dtype="fp32",
                                             decode_graph_max_batch=graph_batches["small"]), acc, base_eff)
    print(f"serving fit on small: multipliers {cal.scales}, roofline_overlap "
          f"{cal.efficiency.roofline_overlap}, attention_fraction {cal.efficiency.attention_fraction:.3f}, "
          f"fit errors {[round(100 * e, 1) for e in cal.errors_after]}%")
    rows = []
    for preset, _, _ in targets:
        setup = ServeSetup(shape=resolve_model(preset), dtype="fp32",
                           decode_graph_max_batch=graph_batches[preset])
        for step in read_engine_steps(summarize(target_records[preset])):
            label = f"{preset} {step.phase} bs{step.batch_size} len{step.length}"
            calibrated = engine_step_work(step, setup, acc, cal.efficiency).total_s
            baseline = engine_step_work(step, setup, acc, base_eff).total_s
            rows.append(compare(label, step.step_s, calibrated, baseline))
    return rows


def training_part(acc, base_eff, steps: int) -> list[dict]:
    from slipstream.perf.measured import fit_train_runs, train_run_work
    from slipstream.perf.records import read_train_run

    calib = read_train_run(run_training("tiny", 8, steps))
    cal = fit_train_runs([calib], acc, base_eff)
    print(f"training fit on tiny b8: multipliers {cal.scales}")
    rows = []
    for preset, batch in (("tiny", 16), ("small", 8)):
        run = read_train_run(run_training(preset, batch, steps))
        rows.append(compare(f"train {preset} b{batch}x256", run.median_step_s,
                            train_run_work(run, acc, cal.efficiency).total_s,
                            train_run_work(run, acc, base_eff).total_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="run even if the machine is busy")
    parser.add_argument("--rounds", type=int, default=3, help="serving measurements per model")
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--train-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_worker:
        preset, batch, steps = args.train_worker
        return train_worker(preset, int(batch), int(steps))
    from slipstream.perf.hardware import BUSY_LOAD_AVERAGE

    load = float(Path("/proc/loadavg").read_text().split()[0])
    if load >= BUSY_LOAD_AVERAGE and not args.force:
        raise SystemExit(f"load average {load} >= {BUSY_LOAD_AVERAGE}: run this on an idle machine "
                         "(or --force)")
    from common import print_json

    from slipstream.perf.efficiency import default_efficiency
    from slipstream.perf.hardware import calibrate, local_accelerator

    RUNS.mkdir(parents=True, exist_ok=True)
    acc = local_accelerator(calibrate(device="cpu"))
    base = default_efficiency(acc)
    print(f"{acc.name}: fp32 {acc.peak_flops('fp32') / 1e9:.0f} GFLOP/s, "
          f"read {acc.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    print(f"{'point':<34}{'meas. ms':>11}{'pred. ms':>11}{'error':>9}{'uncal. ms':>12}{'error':>9}")
    rows = serving_part(acc, base, args.rounds)
    if not args.skip_training:
        rows += training_part(acc, base, args.train_steps)
    errors = [abs(r["error"]) for r in rows]
    baseline = [abs(r["uncalibrated_error"]) for r in rows]
    summary = {"mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors),
               "uncalibrated_mean_abs_error": sum(baseline) / len(baseline),
               "within_15_percent": max(errors) <= 0.15}
    print(f"calibrated: mean {100 * summary['mean_abs_error']:.1f}%, "
          f"max {100 * summary['max_abs_error']:.1f}%; "
          f"uncalibrated mean {100 * summary['uncalibrated_mean_abs_error']:.1f}% "
          f"(ratio {summary['uncalibrated_mean_abs_error'] / summary['mean_abs_error']:.1f}x)")
    print_json({"benchmark": "perf_local_validation", "rows": rows, **summary})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
