"""Linear layers of the bench model's shapes: the panel kernel against oneDNN and PyTorch.

A decode step multiplies a few tens of rows by every weight of the model once, so the weights
come from memory each time. This runs the four projections of every layer of the ~125M bench
model (12 layers of q/k/v 1280x768, o 768x768, gate/up 4096x768, down 768x2048: 48 distinct
weights, 242 MB in fp32, more than the last-level cache) at several row counts, interleaving the
three implementations, and prints the median time per pass, GFLOP/s, the ratio of the panel
kernel to oneDNN (to PyTorch's product where oneDNN cannot multiply the dtype: bf16 on an AVX2
CPU) and the fraction of the calibrated peak of the dtype. Up to
`cpu_kernels.MAX_GEMV_ROWS` rows it also runs the matrix-vector kernel of batch-1 decode, memory
bound, and prints the rate at which it reads the weights against the read bandwidth measured
right before those rows. Last line JSON.

    python benchmarks/linear_kernels.py [--dtype float32|bfloat16|both] [--rows 1 8 ... 2048]
"""

from __future__ import annotations

import argparse

import torch
from common import machine, median, print_json, time_in_turns

from slipstream.ops import cpu_kernels
from slipstream.ops.linear import onednn_multiplies
from slipstream.perf.hardware import calibrate, measure_memory_bandwidth

LAYERS = 12
SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # (out, in) of one layer


def measure(dtype: torch.dtype, rows_list: list[int], repeats: int) -> list[dict]:
    peak = calibrate().peak_flops(dtype)
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    panels = [cpu_kernels.pack_panels(w) for w in weights]
    implementations = {
        "panel": lambda x, i: cpu_kernels.panel_gemm(x, panels[i], None, weights[i].shape[0]),
        "torch": lambda x, i: torch.nn.functional.linear(x, weights[i]),
    }
    baseline = "torch"
    if onednn_multiplies(dtype):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        implementations["onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, onednn[i], None, "none", [], "")
        baseline = "onednn"
    name = str(dtype).removeprefix("torch.")
    print(f"{name} peak (calibrated): {peak / 1e9:.0f} GFLOP/s; {len(weights)} weights, "
          f"{sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB")
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
        flops = sum(2 * rows * w.numel() for w in weights)
        run_now = dict(implementations)
        if rows <= cpu_kernels.MAX_GEMV_ROWS:
            run_now["gemv"] = lambda x, i: cpu_kernels.gemv(x, weights[i], None)
            bandwidth = measure_memory_bandwidth()[0]
        times = time_in_turns(run_now, [(inputs[w.shape[1]], i) for i, w in enumerate(weights)], repeats)
        gflops = {impl: flops / median(t) / 1e9 for impl, t in times.items()}
        ratio = gflops["panel"] / gflops[baseline]
        print(f"{name} M={rows:5d}: " + ", ".join(f"{impl} {g:6.1f}" for impl, g in gflops.items())
              + f" GFLOP/s; panel/{baseline} {ratio:.2f}x,"
              + f" panel at {gflops['panel'] * 1e9 / peak:.0%} of peak")
        results.append({"dtype": name, "rows": rows, "gflops": gflops, "baseline": baseline,
                        "panel_over_baseline": ratio, "panel_fraction_of_peak": gflops["panel"] * 1e9 / peak,
                        "peak_gflops": peak / 1e9})
        if "gemv" in times:
            read = sum(w.numel() * w.element_size() for w in weights) / median(times["gemv"])
            print(f"{name} M={rows:5d}: the matrix-vector kernel reads the weights at {read / 1e9:.1f} GB/s, "
                  f"{read / bandwidth:.0%} of the {bandwidth / 1e9:.1f} GB/s measured before")
            results[-1] |= {"gemv_read_gb_per_s": read / 1e9, "read_gb_per_s": bandwidth / 1e9,
                            "gemv_bandwidth_fraction": read / bandwidth}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    args = parser.parse_args()
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    results = []
    for dtype in dtypes:
        if not cpu_kernels.supports_panel_gemm(torch.empty(1, dtype=dtype)):
            print(f"{dtype}: no panel kernel on this CPU (it needs AVX-512 or AVX2 with FMA)")
            continue
        results += measure(dtype, args.rows, args.repeats)
    print_json({"benchmark": "linear_kernels", "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
