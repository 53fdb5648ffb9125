"""Decode on a GPU: captured CUDA graphs against eager steps, per batch size.

For each batch size, --batch requests (random prompts of --input-len tokens, greedy, ignore_eos)
run through two engines on the same model: the default one, whose pure decode steps replay CUDA
graphs (`slipstream.serve.cuda_graph`), and one with enforce_eager=True, the baseline. Their
decode steps are timed alternately, one request set each in turn, --repeats times; the median step
is the ms per output token. The floor is the bytes a decode step reads (weights and KV cache;
slipstream.perf.flops.decode_bytes_per_step) over the device's memory bandwidth, measured in this
run. Both engines must produce the same greedy tokens. Needs a CUDA device.

    python benchmarks/cuda_decode.py                       # small preset, bf16, batch 1 8 32 64

Last line JSON.
"""

from __future__ import annotations

import time

import torch
from common import ensure_model, machine, median, print_json, random_prompts, serving_parser

from slipstream.model import ModelConfig
from slipstream.perf.flops import decode_bytes_per_step, kv_cache_bytes_per_token
from slipstream.perf.hardware import measure_memory_bandwidth
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.request import SamplingParams


def decode_steps(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[list[float], list]:
    """Step times (s) of the decode steps of one run of `prompts`, and the tokens generated."""
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    times, tokens = [], {}
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        tokens |= {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
    return times[1:], [tokens[f"r{i}"] for i in range(len(prompts))]  # times[0]: the prefill


def main() -> None:
    parser = serving_parser(__doc__)
    parser.set_defaults(dtype="bfloat16", output_len=64)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--input-len", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode.py needs a CUDA device")
    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = max(measure_memory_bandwidth("cuda")[0] for _ in range(2))
    print(f"{torch.cuda.get_device_name()}: read bandwidth {bandwidth / 1e9:.0f} GB/s (measured)")
    print(f"{'dtype':<10}{'batch':>6}{'graphs ms':>11}{'eager ms':>10}{'speed-up':>10}{'of floor':>10}")
    rows = []
    for dtype in dtypes:
        # One step prefills every prompt of a batch; all the later steps are pure decodes. The KV
        # cache holds twice the largest batch, not the default 90% of the GPU: two engines share it.
        tokens_held = 2 * max(batches) * (args.input_len + args.output_len)
        kv_bytes = tokens_held * kv_cache_bytes_per_token(config, dtype)
        engines = {mode: Engine(EngineConfig(model=str(model_dir), dtype=dtype, device="cuda",
                                             max_num_seqs=max(batches),
                                             max_num_batched_tokens=max(batches) * args.input_len,
                                             kv_cache_memory=kv_bytes,
                                             enforce_eager=mode == "eager"))
                   for mode in ("graphs", "eager")}
        for batch in batches:
            prompts = random_prompts(config, batch, args.input_len, args.input_len, seed=batch)
            times: dict[str, list[float]] = {"graphs": [], "eager": []}
            tokens = {}
            for engine in engines.values():
                decode_steps(engine, prompts, 4)  # warm-up (the graphs' first capture)
            for _ in range(args.repeats):
                for mode, engine in engines.items():
                    step_times, tokens[mode] = decode_steps(engine, prompts, args.output_len)
                    times[mode] += step_times
            assert tokens["graphs"] == tokens["eager"], "graphs and eager steps generated different tokens"
            graphs_s, eager_s = median(times["graphs"]), median(times["eager"])
            context = args.input_len + args.output_len // 2
            floor_s = decode_bytes_per_step(config, dtype, batch, context) / bandwidth
            row = {"dtype": dtype, "batch_size": batch, "graphs_ms": 1e3 * graphs_s,
                   "eager_ms": 1e3 * eager_s, "speedup": eager_s / graphs_s,
                   "fraction_of_bandwidth_floor": floor_s / graphs_s,
                   "graphs_captured": engines["graphs"].runner.decode_graph.num_captured}
            rows.append(row)
            print(f"{dtype:<10}{batch:>6}{row['graphs_ms']:>11.3f}{row['eager_ms']:>10.3f}"
                  f"{row['speedup']:>9.2f}x{100 * row['fraction_of_bandwidth_floor']:>9.1f}%")
    print_json({"benchmark": "cuda_decode", "model": str(model_dir), "input_len": args.input_len,
                "output_len": args.output_len, "bandwidth_bytes_per_s": bandwidth, "rows": rows,
                **machine()})


if __name__ == "__main__":
    main()
