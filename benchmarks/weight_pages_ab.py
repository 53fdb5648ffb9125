"""Decode steps with the weights' copies on huge pages against the same engine on 4 KiB pages.

A decode step streams every weight copy it multiplies by (the row-major ones of the
matrix-vector kernel, the panel-packed ones of the panel kernel) from memory. `pack_linears`
puts both on transparent huge pages (`ops.allocator`); this builds two engines on the same model
and dtype, one as shipped and one whose copies are on ordinary 4 KiB pages, and runs their decode
graphs' greedy steps in turns (alternating which goes first) over the same positions, so that a
shared machine's drift hits both alike. Prints each engine's median ms per step, its share of the
read bandwidth (bytes per step from slipstream.perf.flops.decode_bytes_per_step over the higher
of the bandwidths measured before and after the rounds), the median of the per-round ratios with
its quartiles, and each engine's `LLM(...)` construction time (the huge-page one is built first,
so it also pays the process's first-engine costs: the difference is an upper bound), then a JSON
line. Run one dtype per process: a second dtype's engines meet the
first's memory, and measured unlike themselves alone.

    python benchmarks/weight_pages_ab.py --dtype bfloat16 --batch-sizes 1 4 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch
from common import ensure_model, machine, median, print_json

from slipstream import LLM
from slipstream.model import ModelConfig
from slipstream.ops import linear
from slipstream.perf.flops import decode_bytes_per_step
from slipstream.perf.hardware import measure_memory_bandwidth

CONTEXT = 256
"""Each sequence's keys when a timed step starts, as in serve_latency.py's 256-token prompt."""
STEPS = 32


def small_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The baseline's buffers: ordinary CPU memory (4 KiB pages where THP is "madvise")."""
    return torch.empty(numel, dtype=dtype)


def step_ms(graph, batch: int, tables: list[list[int]]) -> float:
    """Mean ms per step over STEPS greedy steps from position CONTEXT, after an untimed one."""
    tokens, positions = [5] * batch, [CONTEXT] * batch
    graph.greedy(tokens, positions, tables, 1)
    start = time.perf_counter()
    for s in range(STEPS):
        graph.greedy(tokens, [CONTEXT + s] * batch, tables, 1)
    return 1e3 * (time.perf_counter() - start) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: the small preset, created once)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--repeats", type=int, default=15, help="rounds, each engine once per round")
    args = parser.parse_args()
    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    dtype, results = args.dtype, []
    engines, build_s = {}, {}
    small_pages = mock.patch.object(linear, "huge_page_empty", small_page_empty)
    for name in ("huge", "4k"):  # huge first: it also pays the process's first-engine costs
        with small_pages if name == "4k" else nullcontext():
            start = time.perf_counter()
            engines[name] = LLM(str(model_dir), dtype=dtype)
            build_s[name] = time.perf_counter() - start
    print(f"{dtype:>8} LLM() built in {build_s['huge']:.2f} s on huge pages, {build_s['4k']:.2f} s on 4 KiB "
          "pages", flush=True)
    graphs = {name: llm.engine.runner.decode_graph for name, llm in engines.items()}
    if None in graphs.values():
        raise SystemExit(f"no CPU decode graph for {dtype} here: nothing to compare")
    for batch in args.batch_sizes:
        blocks = (CONTEXT + STEPS) // 16 + 2
        tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
        before = measure_memory_bandwidth()[0]
        times = {name: [] for name in graphs}
        for r in range(args.repeats):
            for name in (("4k", "huge") if r % 2 == 0 else ("huge", "4k")):
                times[name].append(step_ms(graphs[name], batch, tables))
        bandwidth = max(before, measure_memory_bandwidth()[0])
        ratios = [small / huge for small, huge in zip(times["4k"], times["huge"], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4)
        bytes_per_step = decode_bytes_per_step(config, dtype, batch, CONTEXT)
        ms = {name: median(values) for name, values in times.items()}
        share = {name: bytes_per_step / bandwidth / (ms[name] / 1e3) for name in ms}
        print(f"{dtype:>8} batch {batch:3d}: huge pages {ms['huge']:7.2f} ms/step "
              f"({100 * share['huge']:.1f}% of {bandwidth / 1e9:.1f} GB/s), 4 KiB pages "
              f"{ms['4k']:7.2f} ({100 * share['4k']:.1f}%); 4k/huge per round {median(ratios):.3f} "
              f"[{quartiles[0]:.3f}, {quartiles[2]:.3f}]", flush=True)
        results.append({"batch": batch, "huge_ms": ms["huge"], "small_pages_ms": ms["4k"],
                        "small_over_huge": median(ratios), "quartiles": [quartiles[0], quartiles[2]],
                        "read_gb_per_s": bandwidth / 1e9, "huge_bandwidth_fraction": share["huge"],
                        "small_pages_bandwidth_fraction": share["4k"]})
    print_json({"benchmark": "weight_pages_ab", "machine": machine(), "dtype": dtype, "repeats": args.repeats,
                "context": CONTEXT, "steps": STEPS, "huge_build_s": build_s["huge"],
                "small_pages_build_s": build_s["4k"], "results": results})


if __name__ == "__main__":
    main()
