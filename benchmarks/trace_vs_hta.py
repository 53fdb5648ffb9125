"""`slipstream perf trace` against Holistic Trace Analysis on the same GPU traces.

HTA (facebookresearch/HolisticTraceAnalysis, on PyPI as `traceinsight`) is the reference for
the GPU-side numbers: the temporal breakdown (idle, compute, non-compute over the span of the
kernels), the communication/compute overlap, the idle-time breakdown (host wait, kernel wait,
other, summed over streams) and the CUDA kernel launch statistics (launches, kernels shorter than
their launch call, launch delays, outliers). Install it in a venv of its own (it needs pandas,
no torch):

    python3 -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install --no-deps traceinsight \\
        && /tmp/hta-venv/bin/pip install numpy pandas plotly networkx pydot pyyaml psutil ijson
    python benchmarks/trace_vs_hta.py --hta-python /tmp/hta-venv/bin/python TRACE_DIR ...

Each TRACE_DIR holds one Kineto trace per rank, as HTA takes them (HTA's own test traces, in its
repository's tests/data, are real multi-rank GPU runs). HTA is run with every profiler step (its
default drops the last) and without its rounding of float times to whole microseconds, and
synchronization events (`cuda_sync`: Stream Sync, Context Sync) are taken out of its view:
slipstream does not count them as GPU work (TraceLens's rule; HTA counts them as time the GPU was
busy). Prints one row per rank and metric with the relative difference; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slipstream.perf.trace import analyze  # noqa: E402
from slipstream.perf.trace_gpu import LAUNCH_DELAY_OUTLIER_US, RUNTIME_OUTLIER_US  # noqa: E402

HTA_DRIVER = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from hta.configs.env_options import HTAEnvOptions
from hta.trace_analysis import TraceAnalysis
HTAEnvOptions.instance().set_disable_ns_rounding(True)
ta = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
sync = ta.t.symbol_table.get_sym_id_map().get("cuda_sync")
for rank, df in ta.t.traces.items():
    ta.t.traces[rank] = df[df["cat"] != sync]
ranks = sorted(int(r) for r in ta.t.traces)
out = {r: {"host_wait_us": 0.0, "kernel_wait_us": 0.0, "other_wait_us": 0.0} for r in ranks}
waits = {"host_wait": "host_wait_us", "kernel_wait": "kernel_wait_us", "other": "other_wait_us"}
for row in ta.get_temporal_breakdown(visualize=False).to_dict(orient="records"):
    out[int(row["rank"])].update(idle_us=row["idle_time(us)"], compute_us=row["compute_time(us)"],
                                 non_compute_us=row["non_compute_time(us)"], span_us=row["kernel_time(us)"])
for row in ta.get_comm_comp_overlap(visualize=False).to_dict(orient="records"):
    value = row["comp_comm_overlap_pctg"]
    out[int(row["rank"])]["overlap"] = None if value != value else value / 100
idle = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)[0]
for row in idle.to_dict(orient="records"):
    out[int(row["rank"])][waits[row["idle_category"]]] += row["idle_time"]
runtime_cutoff, launch_delay_cutoff = float(sys.argv[2]), float(sys.argv[3])
stats = ta.get_cuda_kernel_launch_stats(ranks=ranks, runtime_cutoff=runtime_cutoff,
                                        launch_delay_cutoff=launch_delay_cutoff, visualize=False)
for rank, df in stats.items():
    out[int(rank)].update(launches=len(df),
                          shorter_than_launch=int((df["gpu_duration"] < df["cpu_duration"]).sum()),
                          launch_delay_us=float(df["launch_delay"].sum()),
                          runtime_outliers=int((df["cpu_duration"] > runtime_cutoff).sum()),
                          launch_delay_outliers=int((df["launch_delay"] > launch_delay_cutoff).sum()))
print(json.dumps(out))
"""

LAUNCH_METRICS = ("launches", "shorter_than_launch", "launch_delay_us", "runtime_outliers",
                  "launch_delay_outliers")
METRICS = ("span_us", "idle_us", "compute_us", "non_compute_us", "overlap",
           "host_wait_us", "kernel_wait_us", "other_wait_us", *LAUNCH_METRICS)


def run_hta(python: str, trace_dir: Path) -> dict[int, dict[str, float]]:
    cutoffs = [str(RUNTIME_OUTLIER_US), str(LAUNCH_DELAY_OUTLIER_US)]
    result = subprocess.run([python, "-c", HTA_DRIVER, str(trace_dir), *cutoffs],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"HTA failed on {trace_dir}:\n{result.stderr[-3000:]}")
    return {int(rank): values for rank, values in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def ours(trace_dir: Path) -> dict[int, dict[str, float]]:
    """slipstream's whole-trace GPU numbers per rank (HTA calls a trace without a rank rank 0)."""
    out = {}
    for rank in analyze([str(trace_dir)])["ranks"]:
        gpu = rank["gpu"] or {}
        non_compute = gpu.get("exposed_communication_us", 0.0) + gpu.get("exposed_memory_us", 0.0)
        launches = rank["launches"] or dict.fromkeys(LAUNCH_METRICS, 0)  # none matched: HTA's empty table
        number = rank["rank"] or 0
        if number in out:
            raise SystemExit(f"{trace_dir}: two traces of rank {number} (several sessions? HTA reads one "
                             "trace per rank)")
        out[number] = {**gpu, **launches, "non_compute_us": non_compute}
    return out


def relative_difference(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return abs(a - b) / max(abs(b), 1e-9) if (a or b) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dirs", nargs="+", type=Path)
    parser.add_argument("--hta-python", required=True, help="the python of a venv with traceinsight")
    args = parser.parse_args()
    worst = {metric: 0.0 for metric in METRICS}
    rows = 0
    print(f"{'trace':<28} {'rank':>4} {'metric':<15} {'slipstream':>14} {'HTA':>14} {'rel. diff':>10}")
    for trace_dir in args.trace_dirs:
        reference, mine = run_hta(args.hta_python, trace_dir), ours(trace_dir)
        for rank in sorted(reference):
            for metric in METRICS:
                a, b = mine.get(rank, {}).get(metric), reference[rank].get(metric)
                diff = relative_difference(a, b)
                worst[metric] = max(worst[metric], diff)
                rows += 1
                print(f"{trace_dir.name[:28]:<28} {rank:>4} {metric:<15} {_cell(a)} {_cell(b)} {diff:>10.2e}")
    print(json.dumps({"traces": [str(d) for d in args.trace_dirs], "rows": rows,
                      "max_relative_difference": worst}))


def _cell(value: float | None) -> str:
    return f"{'-':>14}" if value is None else f"{value:>14.3f}"


if __name__ == "__main__":
    main()
