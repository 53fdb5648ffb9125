"""Prefill attention: the paged C kernel against the PyTorch path it replaced (gather + SDPA).

One causal prefill of L tokens over a paged cache (shuffled blocks of 16), for head layouts of
the presets (the bench model's 12 query / 4 kv heads of 64, tiny's 6 / 2, medium's 16 / 8, and a
Llama-8B-like 32 / 8 of 128), interleaving the two implementations; then, per layout, one call
shaped like a prefill step of serve_offline.py (prompts of 64-256 tokens, seeded, up to 2,048
tokens; `--no-prompt-batch` leaves it out), which the PyTorch path takes one prompt at a time.
The baseline is what `paged_attention` runs without the kernel: gather the sequence's keys and
values, expand the kv heads, `F.scaled_dot_product_attention` (in bf16 under 385 keys: two
matmuls and a softmax, the faster path there). Prints the median time per call, GFLOP/s over
the causal half (4 H D L(L+1)/2 FLOPs per prompt), the ratio and the fraction of the calibrated
peak of the kernel's arithmetic dtype (bf16 inputs compute in bf16 where the CPU has
AVX512-BF16, else in fp32). Last line JSON.

    python benchmarks/prefill_attention.py [--dtype float32|bfloat16|both] [--lengths 128 ... 2048]
                                           [--no-prompt-batch] [--heads 8/4/256 8/1/256]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import machine, median, print_json

from slipstream.ops import cpu_kernels
from slipstream.ops.paged_attention import _attend, _gather
from slipstream.perf.hardware import calibrate

HEADS = [(12, 4, 64), (6, 2, 64), (16, 8, 64), (32, 8, 128)]  # (query heads, kv heads, head dim)
BLOCK_SIZE = 16


def time_calls(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, lengths: list[int],
               repeats: int) -> dict[str, float]:
    """Median seconds per call of each implementation, interleaved: one call prefills one prompt
    of each of `lengths` tokens."""
    blocks = [-(-length // BLOCK_SIZE) for length in lengths]
    k_cache = torch.randn(sum(blocks) + 8, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    shuffled = torch.randperm(sum(blocks) + 8)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int64)
    for i, n in enumerate(blocks):
        tables[i, :n] = shuffled[sum(blocks[:i]) : sum(blocks[: i + 1])]
    q = torch.randn(sum(lengths), num_heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    lens = torch.tensor(lengths)
    rows = torch.cumsum(lens, 0) - lens

    def kernel() -> None:
        cpu_kernels.paged_prefill_attention_(out, q, k_cache, v_cache, rows, lens, lens, tables, None)

    def pytorch() -> None:
        for row, length, table in zip(rows.tolist(), lengths, tables, strict=True):
            _attend(q[row : row + length], _gather(k_cache, table, length, dtype),
                    _gather(v_cache, table, length, dtype), None)

    implementations = {"kernel": kernel, "torch": pytorch}
    calls = max(1, int(1e9 / flops_of(num_heads, head_dim, lengths)))  # ~3-10 ms per timed batch
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


def flops_of(num_heads: int, head_dim: int, lengths: list[int]) -> float:
    """QK^T and PV over the causal half of each prompt: 4 H D L(L+1)/2."""
    return sum(4 * num_heads * head_dim * length * (length + 1) / 2 for length in lengths)


def prompt_batch(seed: int = 0, budget: int = 2048) -> list[int]:
    """Prompt lengths uniform in 64-256 (serve_offline.py's), as many as fit in `budget` tokens,
    the last one cut to fill it: a prefill step of that workload."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < budget:
        lengths.append(min(rng.randint(64, 256), budget - sum(lengths)))
    return lengths


def measure(dtype: torch.dtype, heads: list[tuple[int, int, int]], lengths: list[int], repeats: int,
            batch: bool) -> list[dict]:
    arithmetic = str(cpu_kernels.arithmetic_dtype(dtype)).removeprefix("torch.")
    peak = calibrate().peak_flops(arithmetic)
    name = str(dtype).removeprefix("torch.")
    torch.manual_seed(0)
    shapes = [[length] for length in lengths] + ([prompt_batch()] if batch else [])
    results = []
    for num_heads, num_kv_heads, head_dim in heads:
        for prompts in shapes:
            seconds = time_calls(dtype, num_heads, num_kv_heads, head_dim, prompts, repeats)
            gflops = {impl: flops_of(num_heads, head_dim, prompts) / s / 1e9 for impl, s in seconds.items()}
            ratio = seconds["torch"] / seconds["kernel"]
            label = (f"L={prompts[0]:5d}" if len(prompts) == 1 else
                     f"{len(prompts)} prompts of {min(prompts)}-{max(prompts)} ({sum(prompts):,} tokens)")
            print(f"{name} heads {num_heads}/{num_kv_heads} x {head_dim} {label}: "
                  f"kernel {1e3 * seconds['kernel']:8.3f} ms {gflops['kernel']:4.0f} GFLOP/s, "
                  f"torch {1e3 * seconds['torch']:8.3f} ms {gflops['torch']:4.0f} GFLOP/s; "
                  f"{ratio:.2f}x, kernel at {gflops['kernel'] * 1e9 / peak:.0%} of the {arithmetic} peak")
            results.append({"dtype": name, "heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim,
                            "lengths": prompts, "seconds": seconds, "gflops": gflops, "speedup": ratio,
                            "kernel_arithmetic": arithmetic,
                            "kernel_fraction_of_peak": gflops["kernel"] * 1e9 / peak})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--heads", nargs="+", default=[f"{h}/{k}/{d}" for h, k, d in HEADS],
                        help="head layouts: query heads / kv heads / head size (Gemma's: 8/4/256, 8/1/256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--no-prompt-batch", dest="prompt_batch", action="store_false",
                        help="leave out the call shaped like a serve_offline.py prefill step")
    args = parser.parse_args()
    if not cpu_kernels.supports_prefill_attention(torch.empty(1, 1, 64)):
        raise SystemExit("no prefill attention kernel on this CPU (it needs AVX-512, or AVX2 and FMA)")
    heads = [tuple(int(n) for n in layout.split("/")) for layout in args.heads]
    if any(len(h) != 3 or h[1] <= 0 or h[0] % h[1] != 0 for h in heads):
        raise SystemExit(f"--heads {' '.join(args.heads)}: want H/K/D, K dividing H")
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    results = [r for dtype in dtypes
               for r in measure(dtype, heads, args.lengths, args.repeats, args.prompt_batch)]
    speedups = [r["speedup"] for r in results]
    print(f"kernel / torch: {min(speedups):.2f}-{max(speedups):.2f}x over {len(results)} shapes")
    print_json({"benchmark": "prefill_attention", "machine": machine(), "results": results,
                "min_speedup": min(speedups), "median_speedup": median(speedups)})


if __name__ == "__main__":
    main()
