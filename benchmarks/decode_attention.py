"""Decode attention: the paged C kernel against the PyTorch path, by batch and context length.

One decode step's attention (one query token per sequence) for the bench model's head layout (12
query / 4 kv heads of 64; `--heads` for another, Gemma's 8/4/256 say), over 12 layers' caches
whose blocks of 16 are shuffled, called layer after layer as a decode step does, so that each call
reads its keys and values from memory, not from the cache of the call before. The baseline is what
`paged_attention` runs without the kernel: gather every sequence's blocks, mask past each length,
two einsums and a softmax (`_batched_decode`), interleaved with the kernel. Prints the median time
per call, the bytes of keys and values read per second and their fraction of the read bandwidth
measured in the same run (the roofline of a decode step's attention), and the ratio. `--sinks`
gives both a random attention-sink logit per query head (gpt-oss's). `--kv-cache-dtype` (the
engine's values: fp8, fp8_e4m3, fp8_e5m2, bfloat16) also times what `paged_attention` runs over a
cache in that dtype (fp8: the C kernel, widening as it reads; a bf16 cache under fp32: the PyTorch
path), with its KV bytes per second counted in the cache's dtype. Last line JSON.

    python benchmarks/decode_attention.py [--dtype float32|bfloat16|both]
    python benchmarks/decode_attention.py --shapes 64x224 16x1024 4x4096    # sequences x keys
    python benchmarks/decode_attention.py --heads 8/1/256 --shapes 1x4096 16x1024
    python benchmarks/decode_attention.py --heads 64/8/64 --shapes 16x1024 --sinks    # gpt-oss
    python benchmarks/decode_attention.py --shapes 16x1024 4x4096 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, median, print_json

from slipstream.ops import cpu_kernels
from slipstream.ops.paged_attention import (
    KV_CACHE_DTYPES,
    PagedBatch,
    _batched_decode,
    paged_attention,
    to_cache_dtype,
)
from slipstream.perf.hardware import measure_memory_bandwidth

BLOCK_SIZE, NUM_LAYERS = 16, 12


def time_calls(dtype: torch.dtype, heads: tuple[int, int, int], num_seqs: int, num_keys: int,
               repeats: int, sinks: bool, kv_dtype: torch.dtype | None) -> dict[str, float]:
    """Median seconds per call of each implementation, over NUM_LAYERS caches in turn; heads is
    (query heads, kv heads, head size); `sinks`: with a random sink logit per query head;
    `kv_dtype`: also "kv", `paged_attention` over the caches in that dtype."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-num_keys // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(NUM_LAYERS)]
    tables = torch.randperm(num_blocks).view(num_seqs, blocks_per_seq)
    batch = PagedBatch.build(seq_lens=[num_keys] * num_seqs, query_lens=[1] * num_seqs,
                             block_tables=tables.tolist(), block_size=BLOCK_SIZE)
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    sink_logits = torch.randn(num_heads).to(dtype) if sinks else None

    def kernel(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                           batch.decode_seq_lens, None, sinks=sink_logits)

    def pytorch(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        _batched_decode(q, k_cache, v_cache, batch, sinks=sink_logits)

    implementations = {"kernel": kernel, "torch": pytorch}
    if kv_dtype is not None:
        narrow = {id(k): (to_cache_dtype(k, kv_dtype), to_cache_dtype(v, kv_dtype)) for k, v in caches}

        def narrow_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
            paged_attention(q, *narrow[id(k_cache)], batch, sinks=sink_logits)

        implementations["kv"] = narrow_cache
    times = {impl: [] for impl in implementations}
    for run in implementations.values():
        run(*caches[0])  # warm-up
    for _ in range(repeats):
        for impl, run in implementations.items():
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                run(k_cache, v_cache)
            times[impl].append((time.perf_counter() - start) / NUM_LAYERS)
    return {impl: median(t) for impl, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["64x224", "16x1024", "4x4096", "1x8192"],
                        help="sequences x keys per sequence")
    parser.add_argument("--heads", default="12/4/64", help="query heads / kv heads / head size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--sinks", action="store_true", help="a random attention sink per query head")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES),
                        help="also time attention over a cache in this dtype (the engine's kv_cache_dtype)")
    args = parser.parse_args()
    if cpu_kernels.library() is None:
        raise SystemExit("the C kernels could not be built here (no C compiler?)")
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    heads = tuple(int(n) for n in args.heads.split("/"))
    if len(heads) != 3 or heads[1] <= 0 or heads[0] % heads[1] != 0:
        raise SystemExit(f"--heads {args.heads}: want H/K/D, K dividing H")
    num_heads, num_kv_heads, head_dim = heads
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    bandwidth = max(measure_memory_bandwidth("cpu")[0] for _ in range(2))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (measured now); {num_heads} query / {num_kv_heads} kv "
          f"heads of {head_dim}, blocks of {BLOCK_SIZE}{', with sinks' if args.sinks else ''}")
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] if args.kv_cache_dtype else None
    kv_header = f"{args.kv_cache_dtype + ' ms':>14}{'GB/s':>7}" if kv_dtype else ""
    print(f"{'dtype':<10}{'seqs':>6}{'keys':>7}{'kernel ms':>11}{'GB/s':>7}{'of bw':>7}{'torch ms':>10}"
          f"{'ratio':>8}{kv_header}")
    results = []
    for dtype in dtypes:
        for num_seqs, num_keys in shapes:
            seconds = time_calls(dtype, heads, num_seqs, num_keys, args.repeats, args.sinks, kv_dtype)
            values = 2 * num_seqs * num_keys * num_kv_heads * head_dim
            kv_bytes = values * dtype.itemsize
            row = {"dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "num_keys": num_keys,
                   "kernel_ms": 1e3 * seconds["kernel"], "torch_ms": 1e3 * seconds["torch"],
                   "kernel_kv_gb_per_s": kv_bytes / seconds["kernel"] / 1e9,
                   "fraction_of_bandwidth": kv_bytes / seconds["kernel"] / bandwidth,
                   "speedup": seconds["torch"] / seconds["kernel"]}
            kv_columns = ""
            if kv_dtype is not None:
                row |= {"kv_cache_dtype": args.kv_cache_dtype, "kv_ms": 1e3 * seconds["kv"],
                        "kv_gb_per_s": values * kv_dtype.itemsize / seconds["kv"] / 1e9}
                kv_columns = f"{row['kv_ms']:>14.3f}{row['kv_gb_per_s']:>7.1f}"
            results.append(row)
            print(f"{row['dtype']:<10}{num_seqs:>6}{num_keys:>7}{row['kernel_ms']:>11.3f}"
                  f"{row['kernel_kv_gb_per_s']:>7.1f}{100 * row['fraction_of_bandwidth']:>6.0f}%"
                  f"{row['torch_ms']:>10.3f}{row['speedup']:>7.2f}x{kv_columns}")
    print_json({"benchmark": "decode_attention", "machine": machine(), "bandwidth_bytes_per_s": bandwidth,
                "heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim, "sinks": args.sinks,
                "results": results})


if __name__ == "__main__":
    main()
