"""Soak drill: train through a random fault about every minute, then check what survived.

A deterministic fp32 run of the `tiny` preset on 2 ranks (`slipstream train --nproc 2
--max-restarts 10`, torchrun's elastic agent, gloo) is hit by one fault of a shuffled plan
every `--fault-every` seconds of training:

| fault | how | recovery |
|---|---|---|
| crash | `faults.crash_at_step` (exit 86) | torchrun restarts both ranks from the newest checkpoint |
| hang | `faults.hang_at_step` | the watchdog dumps stacks and exits; torchrun restarts |
| nan | `faults.nan_at_step` (a NaN weight) | rollback in process, the step's batches skipped |
| kill_during_checkpoint | `faults.kill_during_checkpoint` (SIGKILL mid-write) | restart; no partial commit |
| sigkill | the drill SIGKILLs a random worker | torchrun restarts both ranks |
| preempt | SIGTERM to `slipstream train` | a checkpoint is saved, the job exits; the drill reruns it |

Two short calibration runs (without checkpoints, and with one every 2 steps) measure the step
time and what one asynchronous checkpoint costs (its stall plus the slowdown of the steps its
background write shares the cores with); they set the fault steps, the checkpoint interval
(Young's optimum for a fault every --fault-every seconds) and the hang timeout (6 steps, at
least 5 s). After every fault, every
committed checkpoint must verify (sizes and CRC-32 of its manifest). At the end the run must
have finished, and its final weights must equal bit for bit those of a fault-free run of the same
command (told to skip the same batches as the NaN rollback did). The drill prints the run's
goodput breakdown (`slipstream goodput`; target >= 85%) and, last, one JSON line.

About 11 minutes with the defaults: calibration (~1 min), the faulty run (`--minutes`, 4.5) and
the fault-free reference (about as long, less the faults' cost).

    python benchmarks/soak_drill.py
    python benchmarks/soak_drill.py --minutes 2 --fault-every 30   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import print_json

from slipstream.perf.goodput import format_summary, read_events, summarize
from slipstream.train.checkpoint import (
    CorruptCheckpointError,
    list_checkpoints,
    load_model_state,
    verify_checkpoint,
)

DATA_ROOT = Path(__file__).resolve().parent.parent / "runs" / "bench"
CONFIG_FAULTS = ("crash", "hang", "nan", "kill_during_checkpoint")
EXTERNAL_FAULTS = ("sigkill", "preempt")
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def prepared_data() -> Path:
    from slipstream.model.create import stdlib_tokenizer
    from slipstream.train.data import corpus_documents, prepare_dataset

    out = DATA_ROOT / "data-stdlib-8192"  # the tiny preset's vocabulary; shared with train_throughput
    prepare_dataset(out, stdlib_tokenizer(8192), corpus_documents(["stdlib"]), progress=False)
    return out


def config_args(data_dir: Path, run_dir: Path, steps: int, interval: int, hang_timeout_s: float) -> list[str]:
    return [
        "--model.preset=tiny", f"--data.path={data_dir}", f"--run.dir={run_dir}", "--data.seq_len=256",
        "--training.global_batch_size=8", "--training.micro_batch_size=4", f"--training.steps={steps}",
        "--training.deterministic=true", f"--schedule.warmup_steps={max(steps // 10, 1)}",
        f"--eval.interval={max(steps // 4, 1)}", "--eval.num_batches=1",
        f"--checkpoint.interval={interval}", "--checkpoint.keep_last=2",
        f"--supervisor.hang_timeout_s={hang_timeout_s}", "--supervisor.restart_backoff_s=0.5",
        "--supervisor.max_backoff_s=2", "--logging.tensorboard=false", "--logging.interval=1000",
        "--logging.peak_flops_per_s=1e11",
    ]


def train_command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "slipstream.cli", "train", "--nproc", str(nproc), "--max-restarts", "10",
            *args]


def last_step(run_dir: Path) -> int:
    """The newest step in the run's metrics (read from the file's tail)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - 16384, 0))
        lines = f.read().decode(errors="replace").splitlines()[1:]
    steps = [json.loads(line)["step"] for line in lines if line.startswith('{"kind": "train"')]
    return max(steps, default=0)


def calibrate(nproc: int, data_dir: Path, workdir: Path) -> tuple[float, float]:
    """(seconds per step, seconds one asynchronous checkpoint costs the run), from two 16-step
    runs, without checkpoints and with one every 2 steps: the cost is the step time the second
    run spends more per checkpoint (its background write shares the cores) plus its stall."""
    def records(interval: int) -> tuple[list[float], list[dict]]:
        run_dir = workdir / f"calibration-{interval}"
        shutil.rmtree(run_dir, ignore_errors=True)
        subprocess.run(train_command(nproc, config_args(data_dir, run_dir, 16, interval, 0)), env=ENV,
                       check=True, stdout=subprocess.DEVNULL)
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step_s"] for r in lines if r["kind"] == "train"][2:]  # warm-up
        return steps, [r for r in lines if r["kind"] == "checkpoint" and r["step"] > 2]

    plain, _ = records(0)
    with_saves, saves = records(2)
    stall_s = statistics.median(r["checkpoint_s"] for r in saves)
    interference_s = max(sum(with_saves) - sum(plain), 0.0) / len(saves)
    return statistics.median(plain), stall_s + interference_s


def young_interval(step_s: float, checkpoint_cost_s: float, mtbf_s: float) -> int:
    """Steps between checkpoints that minimise checkpoint cost plus recomputed work when faults
    come every `mtbf_s` on average: sqrt(2 * cost * MTBF) (Young, "A first order approximation to
    the optimum checkpoint interval", CACM 17(9), 1974)."""
    return max(round(math.sqrt(2 * checkpoint_cost_s * mtbf_s) / step_s), 1)


def plan_faults(
    rng: random.Random, steps: int, step_s: float, every_s: float, interval: int
) -> list[tuple[int, str]]:
    """(step, fault) about every `every_s` seconds of training, a shuffled mix of all kinds."""
    kinds = list(CONFIG_FAULTS + EXTERNAL_FAULTS)
    rng.shuffle(kinds)
    plan, used = [], set()
    for i in range(1, 100):
        step = int(i * every_s / step_s * rng.uniform(0.85, 1.15))
        if step >= steps - 5 or not kinds:
            break
        kind = kinds.pop()
        if kind == "kill_during_checkpoint":
            step = -(-step // interval) * interval
        while step in used:
            step += 1
        used.add(step)
        plan.append((step, kind))
    return plan


def worker_pids(launcher: subprocess.Popen) -> list[int]:
    """The training processes: children of torchrun, the launcher's child."""
    def children(pid: int) -> list[int]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
        return found

    return [w for agent in children(launcher.pid) for w in children(agent)]


def verify_all(run_dir: Path) -> int:
    """Every committed checkpoint verifies; returns how many there are (retention may delete
    one while we read it: that one is not counted)."""
    count = 0
    for _, path in list_checkpoints(run_dir):
        try:
            verify_checkpoint(path)
            count += 1
        except CorruptCheckpointError:
            if path.exists():
                raise
    return count


def run_with_faults(args, data_dir: Path, run_dir: Path, steps: int, interval: int, hang_s: float,
                    plan: list[tuple[int, str]], rng: random.Random) -> list[dict]:
    """Run the faulty job to the end: config faults fire by themselves, the drill injects the
    external ones and reruns the command after a preemption. Returns a log of what happened."""
    config_faults = {kind: step for step, kind in plan if kind in CONFIG_FAULTS}
    faults = [f"--faults.{kind if kind == 'kill_during_checkpoint' else kind + '_at_step'}={step}"
              for kind, step in config_faults.items()]
    faults.append(f"--faults.rank={rng.randrange(args.nproc)}")
    command = train_command(args.nproc, config_args(data_dir, run_dir, steps, interval, hang_s) + faults)
    log, done = [], set()
    start = time.monotonic()
    while True:
        launcher = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        preempted = False
        while launcher.poll() is None:
            time.sleep(0.25)
            step = last_step(run_dir)
            for fault in [f for f in plan if f[0] <= step and f not in done]:
                fault_step, kind = fault
                if kind == "sigkill":
                    workers = worker_pids(launcher)
                    if not workers:  # between attempts: try again at the next poll
                        continue
                    os.kill(rng.choice(workers), signal.SIGKILL)
                elif kind == "preempt":
                    launcher.send_signal(signal.SIGTERM)
                    preempted = True
                done.add(fault)
                log.append({"fault": kind, "step": fault_step, "at_s": round(time.monotonic() - start, 1),
                            "checkpoints_verified": verify_all(run_dir)})
                print(f"  {log[-1]['at_s']:>6}s  step {fault_step:>5}: {kind} "
                      f"({log[-1]['checkpoints_verified']} committed checkpoints verify)", flush=True)
        events = read_events(run_dir)
        finished = events[-1]["event"] == "end" and events[-1]["reason"] == "finished"
        if finished and last_step(run_dir) >= steps:
            return log
        if not preempted:
            raise RuntimeError(f"the job failed with status {launcher.returncode}; see {run_dir}")
        print(f"  {time.monotonic() - start:>6.1f}s  rerunning the command after the preemption", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=4.5, help="training time of the faulty run")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=str(DATA_ROOT.parent / "drill"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    drill_start = time.monotonic()
    load_before = os.getloadavg()[0]
    data_dir = prepared_data()

    step_s, checkpoint_cost_s = calibrate(args.nproc, data_dir, workdir)
    steps = int(args.minutes * 60 / step_s)
    interval = young_interval(step_s, checkpoint_cost_s, args.fault_every)
    hang_s = max(5.0, 6 * step_s)
    plan = plan_faults(rng, steps, step_s, args.fault_every, interval)
    print(f"{step_s:.2f}s per step, {checkpoint_cost_s:.2f}s per checkpoint: {steps} steps, a checkpoint "
          f"every {interval} (Young's interval for a fault every {args.fault_every:.0f}s), hang timeout "
          f"{hang_s:.0f}s; faults: " + ", ".join(f"{kind} at step {step}" for step, kind in plan), flush=True)

    run_dir, reference_dir = workdir / "run", workdir / "reference"
    for d in (run_dir, reference_dir):
        shutil.rmtree(d, ignore_errors=True)
    faulty_start = time.monotonic()
    log = run_with_faults(args, data_dir, run_dir, steps, interval, hang_s, plan, rng)
    faulty_s = time.monotonic() - faulty_start
    verified = verify_all(run_dir)
    summary = summarize(read_events(run_dir))
    print(format_summary(summary), flush=True)

    reference_dir.mkdir(parents=True)
    if (run_dir / "skipped_windows.jsonl").is_file():
        shutil.copy(run_dir / "skipped_windows.jsonl", reference_dir / "skipped_windows.jsonl")
    reference_start = time.monotonic()
    subprocess.run(train_command(args.nproc, config_args(data_dir, reference_dir, steps, interval, hang_s)),
                   env=ENV, check=True, stdout=subprocess.DEVNULL)
    reference_s = time.monotonic() - reference_start
    final = f"step-{steps:08d}"
    ours = load_model_state(run_dir / "checkpoints" / final)
    theirs = load_model_state(reference_dir / "checkpoints" / final)
    equal = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    print(f"faulty run {faulty_s:.0f}s, fault-free reference {reference_s:.0f}s; final weights "
          f"{'bitwise equal' if equal else 'DIFFER'}; {verified} committed checkpoints verify; goodput "
          f"{100 * summary['goodput']:.1f}% (target >= 85%)")
    print_json({
        "benchmark": "soak_drill", "nproc": args.nproc, "steps": steps, "step_s": step_s,
        "checkpoint_cost_s": checkpoint_cost_s,
        "checkpoint_interval": interval, "faults": log, "finished": summary["finished"],
        "weights_equal_fault_free": equal, "checkpoints_verified": verified,
        "goodput": summary["goodput"], "goodput_seconds": summary["seconds"],
        "restarts": summary["restarts"], "rollbacks": summary["rollbacks"],
        "faulty_run_s": faulty_s, "reference_run_s": reference_s,
        "drill_s": time.monotonic() - drill_start, "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0], "target_met": equal and summary["goodput"] >= 0.85,
    })


if __name__ == "__main__":
    main()
