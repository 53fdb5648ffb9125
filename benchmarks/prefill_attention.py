"""Prefill attention: the paged C kernel against the PyTorch path it replaced (gather + SDPA).

One causal prefill of L tokens over a paged cache (shuffled blocks of 16), for head layouts of
the presets (the bench model's 12 query / 4 kv heads of 64, tiny's 6 / 2, medium's 16 / 8, and a
Llama-8B-like 32 / 8 of 128), interleaving the two implementations. The baseline is what
`paged_attention` runs without the kernel: gather the sequence's keys and values, expand the kv
heads, `F.scaled_dot_product_attention` (in bf16 under 385 keys: two matmuls and a softmax, the
faster path there). Prints the median time per call, GFLOP/s over the causal half (4 H D L(L+1)/2
FLOPs), the ratio and the fraction of the calibrated peak of the kernel's arithmetic dtype (bf16
inputs compute in bf16 where the CPU has AVX512-BF16, else in fp32).
Last line JSON.

    python benchmarks/prefill_attention.py [--dtype float32|bfloat16|both] [--lengths 128 ... 2048]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, median, print_json

from slipstream.ops import cpu_kernels
from slipstream.ops.paged_attention import _attend, _gather
from slipstream.perf.hardware import calibrate

HEADS = [(12, 4, 64), (6, 2, 64), (16, 8, 64), (32, 8, 128)]  # (query heads, kv heads, head dim)
BLOCK_SIZE = 16


def time_calls(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, length: int,
               repeats: int) -> dict[str, float]:
    """Median seconds per call of each implementation, interleaved."""
    num_blocks = -(-length // BLOCK_SIZE)
    k_cache = torch.randn(num_blocks + 8, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks + 8)[:num_blocks]
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    rows, lens = torch.tensor([0]), torch.tensor([length])

    def kernel() -> None:
        cpu_kernels.paged_prefill_attention_(out, q, k_cache, v_cache, rows, lens, lens, table[None], None)

    def pytorch() -> None:
        _attend(q, _gather(k_cache, table, length), _gather(v_cache, table, length), None)

    implementations = {"kernel": kernel, "torch": pytorch}
    calls = max(1, int(1e9 / flops_of(num_heads, head_dim, length)))  # ~3-10 ms per timed batch
    times = {impl: [] for impl in implementations}
    for run in implementations.values():
        run()  # warm-up
    for _ in range(repeats):
        for impl, run in implementations.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[impl].append((time.perf_counter() - start) / calls)
    return {impl: median(t) for impl, t in times.items()}


def flops_of(num_heads: int, head_dim: int, length: int) -> float:
    """QK^T and PV over the causal half: 4 H D L(L+1)/2."""
    return 4 * num_heads * head_dim * length * (length + 1) / 2


def measure(dtype: torch.dtype, lengths: list[int], repeats: int) -> list[dict]:
    arithmetic = str(cpu_kernels.arithmetic_dtype(dtype)).removeprefix("torch.")
    peak = calibrate().peak_flops(arithmetic)
    name = str(dtype).removeprefix("torch.")
    torch.manual_seed(0)
    results = []
    for num_heads, num_kv_heads, head_dim in HEADS:
        for length in lengths:
            seconds = time_calls(dtype, num_heads, num_kv_heads, head_dim, length, repeats)
            gflops = {impl: flops_of(num_heads, head_dim, length) / s / 1e9 for impl, s in seconds.items()}
            ratio = seconds["torch"] / seconds["kernel"]
            print(f"{name} heads {num_heads}/{num_kv_heads} x {head_dim} L={length:5d}: "
                  f"kernel {1e3 * seconds['kernel']:8.3f} ms {gflops['kernel']:4.0f} GFLOP/s, "
                  f"torch {1e3 * seconds['torch']:8.3f} ms {gflops['torch']:4.0f} GFLOP/s; "
                  f"{ratio:.2f}x, kernel at {gflops['kernel'] * 1e9 / peak:.0%} of the {arithmetic} peak")
            results.append({"dtype": name, "heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim,
                            "length": length, "seconds": seconds, "gflops": gflops, "speedup": ratio,
                            "kernel_arithmetic": arithmetic,
                            "kernel_fraction_of_peak": gflops["kernel"] * 1e9 / peak})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    args = parser.parse_args()
    if not cpu_kernels.supports_prefill_attention(torch.empty(1, 1, 64)):
        raise SystemExit("no prefill attention kernel on this CPU (it needs AVX-512, or AVX2 and FMA)")
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    results = [r for dtype in dtypes for r in measure(dtype, args.lengths, args.repeats)]
    speedups = [r["speedup"] for r in results]
    print(f"kernel / torch: {min(speedups):.2f}-{max(speedups):.2f}x over {len(results)} shapes")
    print_json({"benchmark": "prefill_attention", "machine": machine(), "results": results,
                "min_speedup": min(speedups), "median_speedup": median(speedups)})


if __name__ == "__main__":
    main()
