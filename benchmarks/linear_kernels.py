"""fp32 linear layers of the bench model's shapes: the panel kernel against oneDNN and PyTorch.

A decode step multiplies a few tens of rows by every weight of the model once, so the weights
come from memory each time. This runs the four projections of every layer of the ~125M bench
model (12 layers of q/k/v 1280x768, o 768x768, gate/up 4096x768, down 768x2048: 48 distinct
weights, 242 MB in fp32, more than the last-level cache) at several row counts, interleaving the
three implementations, and prints the median time per pass, GFLOP/s, the ratio of the panel
kernel to oneDNN and the fraction of the calibrated fp32 peak. Last line JSON.

    python benchmarks/linear_kernels.py [--rows 1 8 16 32 64 128 512 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, median, print_json

from slipstream.ops import cpu_kernels
from slipstream.perf.hardware import calibrate

LAYERS = 12
SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # (out, in) of one layer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels.supports_panel_gemm(torch.empty(1)):
        raise SystemExit("the panel kernel needs a CPU with AVX-512 and a C compiler")
    peak = calibrate().peak_flops(torch.float32)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    panels = [cpu_kernels.pack_panels(w) for w in weights]
    implementations = {
        "panel": lambda x, i: cpu_kernels.panel_gemm(x, panels[i], None, weights[i].shape[0]),
        "onednn": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "torch": lambda x, i: torch.nn.functional.linear(x, weights[i]),
    }
    print(f"fp32 peak (calibrated): {peak / 1e9:.0f} GFLOP/s; {len(weights)} weights, "
          f"{sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB")
    results = []
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for _, k in SHAPES}
        flops = sum(2 * rows * w.numel() for w in weights)
        times = {name: [] for name in implementations}
        for _ in range(args.repeats):
            for name, run in implementations.items():
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    run(inputs[w.shape[1]], i)
                times[name].append(time.perf_counter() - start)
        gflops = {name: flops / median(t) / 1e9 for name, t in times.items()}
        ratio = gflops["panel"] / gflops["onednn"]
        print(f"M={rows:5d}: " + ", ".join(f"{name} {g:6.1f}" for name, g in gflops.items())
              + f" GFLOP/s; panel/oneDNN {ratio:.2f}x, panel at {gflops['panel'] * 1e9 / peak:.0%} of peak")
        results.append({"rows": rows, "gflops": gflops, "panel_over_onednn": ratio,
                        "panel_fraction_of_peak": gflops["panel"] * 1e9 / peak})
    print_json({"benchmark": "linear_kernels", "machine": machine(), "peak_gflops": peak / 1e9,
                "results": results})


if __name__ == "__main__":
    main()
