"""Decode attention: the paged C kernel against the PyTorch path, by batch and context length.

One decode step's attention (one query token per sequence) for the bench model's head layout (12
query / 4 kv heads of 64; `--heads` for another, Gemma's 8/4/256 say), over 12 layers' caches
whose blocks of 16 are shuffled, called layer after layer as a decode step does, so that each call
reads its keys and values from memory, not from the cache of the call before. The baseline is what
`paged_attention` runs without the kernel: gather every sequence's blocks, mask past each length,
two einsums and a softmax (`_batched_decode`), interleaved with the kernel. Prints the median time
per call, the bytes of keys and values read per second and their fraction of the read bandwidth
measured in the same run (the roofline of a decode step's attention), and the ratio. `--sinks`
gives both a random attention-sink logit per query head (gpt-oss's). Last line JSON.

    python benchmarks/decode_attention.py [--dtype float32|bfloat16|both]
    python benchmarks/decode_attention.py --shapes 64x224 16x1024 4x4096    # sequences x keys
    python benchmarks/decode_attention.py --heads 8/1/256 --shapes 1x4096 16x1024
    python benchmarks/decode_attention.py --heads 64/8/64 --shapes 16x1024 --sinks    # gpt-oss
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, median, print_json

from slipstream.ops import cpu_kernels
from slipstream.ops.paged_attention import PagedBatch, _batched_decode
from slipstream.perf.hardware import measure_memory_bandwidth

BLOCK_SIZE, NUM_LAYERS = 16, 12


def time_calls(dtype: torch.dtype, heads: tuple[int, int, int], num_seqs: int, num_keys: int,
               repeats: int, sinks: bool) -> dict[str, float]:
    """Median seconds per call of each implementation, over NUM_LAYERS caches in turn; heads is
    (query heads, kv heads, head size); `sinks`: with a random sink logit per query head."""
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
    print(f"{'dtype':<10}{'seqs':>6}{'keys':>7}{'kernel ms':>11}{'GB/s':>7}{'of bw':>7}{'torch ms':>10}"
          f"{'ratio':>8}")
    results = []
    for dtype in dtypes:
        for num_seqs, num_keys in shapes:
            seconds = time_calls(dtype, heads, num_seqs, num_keys, args.repeats, args.sinks)
            element_bytes = torch.empty((), dtype=dtype).element_size()
            kv_bytes = 2 * num_seqs * num_keys * num_kv_heads * head_dim * element_bytes
            row = {"dtype": str(dtype).removeprefix("torch."), "num_seqs": num_seqs, "num_keys": num_keys,
                   "kernel_ms": 1e3 * seconds["kernel"], "torch_ms": 1e3 * seconds["torch"],
                   "kernel_kv_gb_per_s": kv_bytes / seconds["kernel"] / 1e9,
                   "fraction_of_bandwidth": kv_bytes / seconds["kernel"] / bandwidth,
                   "speedup": seconds["torch"] / seconds["kernel"]}
            results.append(row)
            print(f"{row['dtype']:<10}{num_seqs:>6}{num_keys:>7}{row['kernel_ms']:>11.3f}"
                  f"{row['kernel_kv_gb_per_s']:>7.1f}{100 * row['fraction_of_bandwidth']:>6.0f}%"
                  f"{row['torch_ms']:>10.3f}{row['speedup']:>7.2f}x")
    print_json({"benchmark": "decode_attention", "machine": machine(), "bandwidth_bytes_per_s": bandwidth,
                "heads": num_heads, "kv_heads": num_kv_heads, "head_dim": head_dim, "sinks": args.sinks,
                "results": results})


if __name__ == "__main__":
    main()
