"""Weight-only int8 linears of the bench model's shapes: the C int8 kernel against the dense
layer of the same dtype and against PyTorch's own int8 product.

A decode step reads every weight of the model once, so int8 weights (a quarter of fp32's bytes,
half of bf16's) should make memory-bound steps faster. This runs the four projections of every
layer of the ~125M bench model as the optimised model holds them (fused q/k/v 1280x768, o
768x768, fused gate/up 4096x768, down 768x2048; 12 layers: 48 distinct weights, more than the
last-level cache) at several row counts, interleaving three implementations in each repeat:

- int8: `PackedInt8Linear`, the C int8 panel kernel (cpu_ops.c);
- dense: `PackedLinear` of the same dtype with its extra copies, as `optimize_for_cpu_inference`
  makes it (the matrix-vector kernel, the panel kernel or oneDNN, by row count);
- torch: `torch.ops.aten._weight_int8pack_mm`, PyTorch's weight-only int8 CPU product (the same
  format: int8 rows and one scale per output channel), only up to `--torch-max-rows` rows: it
  is far slower (5 ms for one row of 2048x768 on the development VM).

It prints the median time per pass over the 48 weights, GFLOP/s, the int8/dense speed ratio (the
median of the repeats' ratios: the two run back to back in each repeat, under the same load), the
rate at which each implementation reads its weights and that rate's fraction of the read
bandwidth measured right before each row count (`perf.hardware.measure_memory_bandwidth`, as
serve_latency.py gets it), and a last line of JSON.

    python benchmarks/int8_linear.py [--dtype float32|bfloat16|both] [--rows 1 8 64 256 2048]
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import machine, median, print_json, time_in_turns
from torch import nn

from slipstream.ops import cpu_kernels
from slipstream.ops.linear import PackedLinear
from slipstream.ops.quant import Int8Linear, PackedInt8Linear
from slipstream.perf.hardware import measure_memory_bandwidth

LAYERS = 12
SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # (out, in) of one layer, fused


def _layers(dtype: torch.dtype) -> tuple[list[nn.Module], list[nn.Module], list[tuple]]:
    """(int8 layers, dense layers, torch's (int8 weight, scales) pairs) for the 48 weights."""
    torch.manual_seed(0)
    int8, dense, torch_int8 = [], [], []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
            plain = Int8Linear(linear)
            torch_int8.append((plain.qweight, plain.scale.to(dtype)))
            int8.append(PackedInt8Linear(copy.deepcopy(plain)))
            dense.append(PackedLinear(linear, extra_copies=True))
    return int8, dense, torch_int8


def measure(dtype: torch.dtype, rows_list: list[int], repeats: int, torch_max_rows: int) -> list[dict]:
    int8, dense, torch_int8 = _layers(dtype)
    name = str(dtype).removeprefix("torch.")
    weights = sum(n * k for n, k in SHAPES) * LAYERS
    weight_bytes = {"int8": weights + 4 * sum(n for n, _ in SHAPES) * LAYERS,  # values and fp32 scales
                    "dense": weights * dtype.itemsize,
                    "torch": weights + dtype.itemsize * sum(n for n, _ in SHAPES) * LAYERS}
    print(f"{name}: {len(int8)} weights; int8 {weight_bytes['int8'] / 1e6:.0f} MB, "
          f"dense {weight_bytes['dense'] / 1e6:.0f} MB")
    implementations = {
        "int8": lambda x, i: int8[i](x),
        "dense": lambda x, i: dense[i](x),
        "torch": lambda x, i: torch.ops.aten._weight_int8pack_mm(x, *torch_int8[i]),
    }
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}
        run_now = {impl: run for impl, run in implementations.items()
                   if impl != "torch" or rows <= torch_max_rows}
        bandwidth = measure_memory_bandwidth()[0]
        times = time_in_turns(run_now, [(inputs[layer.in_features], i) for i, layer in enumerate(int8)],
                              repeats)
        seconds = {impl: median(t) for impl, t in times.items()}
        read = {impl: weight_bytes[impl] / s for impl, s in seconds.items()}
        gflops = {impl: 2 * rows * weights / s / 1e9 for impl, s in seconds.items()}
        ratio = _speedup(times, "dense")
        timings = ", ".join(f"{impl} {1e3 * s:7.2f} ms ({gflops[impl]:6.1f} GFLOP/s, "
                            f"{read[impl] / 1e9:5.1f} GB/s)" for impl, s in seconds.items())
        print(f"{name} M={rows:5d}: {timings}; int8/dense {ratio:.2f}x; int8 reads at "
              f"{read['int8'] / bandwidth:.0%} of {bandwidth / 1e9:.1f} GB/s")
        results.append({
            "dtype": name, "rows": rows, "ms": {impl: 1e3 * s for impl, s in seconds.items()},
            "gflops": gflops, "read_gb_per_s": {impl: r / 1e9 for impl, r in read.items()},
            "bandwidth_fraction": {impl: r / bandwidth for impl, r in read.items()},
            "measured_read_gb_per_s": bandwidth / 1e9, "int8_speedup_over_dense": ratio,
            "int8_speedup_over_torch": _speedup(times, "torch") if "torch" in times else None,
        })
    return results


def _speedup(times: dict[str, list[float]], baseline: str) -> float:
    """The median over the repeats of baseline time / int8 time: the two run back to back in each
    repeat, so on a shared machine both sides of a ratio see about the same load."""
    return median([b / i for b, i in zip(times[baseline], times["int8"], strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch-max-rows", type=int, default=64,
                        help="run PyTorch's _weight_int8pack_mm only up to this many rows (it is slow)")
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    args = parser.parse_args()
    for name, value in (("--repeats", args.repeats), ("--torch-max-rows", args.torch_max_rows),
                        ("--rows", min(args.rows))):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    results = []
    for dtype in dtypes:
        if not cpu_kernels.supports_int8(torch.empty(0, dtype=dtype)):
            print(f"{dtype}: no C int8 kernel on this CPU (it needs AVX-512 or AVX2 with FMA)")
            continue
        results += measure(dtype, args.rows, args.repeats, args.torch_max_rows)
    print_json({"benchmark": "int8_linear", "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
