"""Tensor-parallel serving against one process: offline throughput and batch-1 decode latency.

The same engine split over --tensor-parallel-size processes (each with its share of this
process's threads) and, as the baseline in the same run, on one process with all of them
(the default engine, C decode graph included). Offline: --num-prompts random prompts of
--input-len-range tokens, --output-len greedy tokens each (ignore_eos); the engines run in turns,
--repeats rounds, and the ratio is the median of the rounds' ratios; MFU is over this machine's
calibrated peak at its full thread count (slipstream.perf.flops.generation_flops). Latency: one
request of --input-len tokens decoding step by step, the median step per token against the
memory-bandwidth roofline (decode bytes per step over the read bandwidth measured around each
repeat at the full thread count), as serve_latency.py measures it, and also for one process
running module by module (enforce_eager), as the split engine's steps run: the two ratios tell
what splitting costs from what eager steps cost.

On a CPU the ranks share one memory system, so splitting a model buys no bandwidth; what it
costs (eager steps, the all-reduces over gloo, the step's inputs pickled to each worker) is what
this measures. On GPUs each rank brings its own memory and FLOPs.

    python benchmarks/serve_tensor_parallel.py --dtype float32

Last line JSON.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from common import ensure_model, machine, median, print_json, random_prompts, serving_parser
from serve_latency import measure, summary
from serve_offline import run_rounds, slipstream_runner

from slipstream import LLM
from slipstream.model import ModelConfig
from slipstream.perf.flops import decode_bytes_per_step, generation_flops
from slipstream.perf.hardware import calibrate


def with_threads(run: Callable[[], float]) -> Callable[[], float]:
    """`run` under the intra-op thread count set when its engine was made: a split engine gives
    this process its share of the threads, and one process has one count for all its engines."""
    threads = torch.get_num_threads()

    def run_with_threads() -> float:
        torch.set_num_threads(threads)
        return run()

    return run_with_threads


def main() -> None:
    parser = serving_parser(__doc__)
    parser.set_defaults(output_len=64)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--input-len", type=int, default=256, help="the latency request's prompt")
    args = parser.parse_args()

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompts = random_prompts(config, args.num_prompts, *args.input_len_range, seed=0)
    num_output_tokens = args.num_prompts * args.output_len
    total_flops = sum(generation_flops(config, len(p), args.output_len) for p in prompts)
    calibration = calibrate()  # the whole machine's, before a split engine shares out the threads
    full_threads = torch.get_num_threads()
    tp = args.tensor_parallel_size
    split, single = f"tp{tp}", "tp1"
    record = {"benchmark": "serve_tensor_parallel", "model": str(model_dir), "tensor_parallel_size": tp,
              "num_prompts": args.num_prompts, "input_len_range": list(args.input_len_range),
              "output_len": args.output_len, "input_len": args.input_len, **machine()}
    for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        runners = {name: with_threads(slipstream_runner(model_dir, dtype, prompts, args.output_len,
                                                        {"tensor_parallel_size": size}))
                   for name, size in ((single, 1), (split, tp))}
        times = run_rounds(runners, args.repeats)
        del runners
        gc.collect()
        tok_per_s = {name: [num_output_tokens / t for t in ts] for name, ts in times.items()}
        ratio = median([s / o for s, o in zip(tok_per_s[split], tok_per_s[single], strict=True)])
        peak = calibration.peak_flops(dtype)
        for name in (single, split):
            mfu = total_flops / median(times[name]) / peak
            print(f"{dtype:>8} {name}: {median(tok_per_s[name]):7.0f} output tok/s, {100 * mfu:4.1f}% MFU "
                  f"(rounds: {', '.join(f'{t:.2f}' for t in times[name])} s)", flush=True)
            record |= {f"{dtype}_{name}_output_tok_per_s": median(tok_per_s[name]),
                       f"{dtype}_{name}_mfu": mfu}
        print(f"{dtype:>8} offline throughput {split} / {single}: {ratio:.2f}x", flush=True)
        record[f"{dtype}_offline_ratio"] = ratio

        prompt = random_prompts(config, 1, args.input_len, args.input_len, seed=1)[0]
        contexts = range(args.input_len + 1, args.input_len + args.output_len)
        bytes_per_step = sum(decode_bytes_per_step(config, dtype, 1, c) for c in contexts) / len(contexts)
        eager = f"{single}-eager"
        engines = {}  # name -> (LLM, the threads its steps run with)
        for name, size in ((single, 1), (eager, 1), (split, tp)):
            torch.set_num_threads(full_threads)
            llm = LLM(str(model_dir), dtype=dtype, tensor_parallel_size=size, enforce_eager=name == eager)
            engines[name] = (llm, torch.get_num_threads())
        repeats = {name: [] for name in engines}
        for _ in range(args.repeats):  # in turns, so that all meet the same minutes of the machine
            for name, (llm, threads) in engines.items():
                torch.set_num_threads(full_threads)  # the roofline of every engine alike: all threads
                label = f"{dtype:>8} {name}"
                repeats[name].append(measure(llm, label, prompt, args.output_len, bytes_per_step,
                                             decode_threads=threads))
        engines[split][0].engine.shutdown()
        del engines
        gc.collect()
        torch.set_num_threads(full_threads)
        for name in repeats:
            record |= summary(f"{dtype}_{name}", repeats[name], bytes_per_step)
        latency_ratio = record[f"{dtype}_{split}_ms_per_token"] / record[f"{dtype}_{single}_ms_per_token"]
        eager_ratio = record[f"{dtype}_{split}_ms_per_token"] / record[f"{dtype}_{eager}_ms_per_token"]
        for name in repeats:
            print(f"{dtype:>8} {name}: {record[f'{dtype}_{name}_ms_per_token']:6.2f} ms/token, "
                  f"{100 * record[f'{dtype}_{name}_bandwidth_fraction']:4.1f}% of the bandwidth roofline",
                  flush=True)
        print(f"{dtype:>8} batch-1 ms/token {split} / {eager}: {eager_ratio:.2f}x", flush=True)
        print(f"{dtype:>8} batch-1 ms/token {split} / {single}: {latency_ratio:.2f}x", flush=True)
        record |= {f"{dtype}_latency_ratio": latency_ratio, f"{dtype}_latency_ratio_to_eager": eager_ratio}
    print_json(record)


if __name__ == "__main__":
    main()
