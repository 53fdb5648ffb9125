"""Offline serving throughput: slipstream's LLM.generate against transformers' batched generate.

Workload (deterministic): N requests of random token ids with prompt lengths uniform in a range,
a fixed number of output tokens with ignore_eos, greedy. Slipstream gets all requests at once;
transformers runs left-padded greedy `generate` in batches, at each batch size given, and its
best batch size is the baseline. Slipstream and transformers run in this process on the same
model and dtype (vLLM in its own venv); every engine's time is the median of --repeats runs.

    python benchmarks/serve_offline.py                       # ~125M preset, fp32 and bf16
    python benchmarks/serve_offline.py --dtype bfloat16 --hf-batch-sizes 16,64

Prints output tok/s, total (prompt + output) tok/s, the ratio to transformers, and MFU against
the calibrated peak (model FLOPs from slipstream.perf.flops.generation_flops); last line JSON.
"""

from __future__ import annotations

import gc
import time

import torch
from common import ensure_model, machine, median, print_json, random_prompts, serving_parser
from vllm_driver import run_vllm_driver

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.perf.flops import generation_flops
from slipstream.perf.hardware import calibrate


def run_slipstream(model_dir, dtype, prompts, output_len, repeats, engine_args):
    llm = LLM(str(model_dir), dtype=dtype, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()  # every repeat computes every prompt: same prompts, cold cache
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    del llm
    gc.collect()
    return median(times), times


def run_transformers(model_dir, dtype, prompts, output_len, batch_size, repeats):
    """Median seconds over `repeats` runs of every prompt, `batch_size` at a time, and the times."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    times = [_transformers_once(model, prompts, output_len, batch_size) for _ in range(repeats)]
    del model
    gc.collect()
    return median(times), times


def _transformers_once(model, prompts, output_len, batch_size):
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def run_vllm(vllm_python, model_dir, dtype, prompts, output_len, repeats, engine_args):
    """vLLM's CPU backend on the same prompts and engine limits, in a subprocess of its own venv."""
    return run_vllm_driver(
        vllm_python,
        model_dir,
        dtype,
        prompts,
        output_len,
        repeats,
        "offline",
        [
            "--max-num-seqs",
            str(engine_args["max_num_seqs"]),
            "--max-num-batched-tokens",
            str(engine_args["max_num_batched_tokens"]),
        ],
    )


def main() -> None:
    parser = serving_parser(__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--hf-batch-sizes", default="16,64", help="comma-separated; empty skips transformers")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompts = random_prompts(config, args.num_prompts, *args.input_len_range, seed=args.seed)
    num_prompt_tokens = sum(map(len, prompts))
    num_output_tokens = args.num_prompts * args.output_len
    total_flops = sum(generation_flops(config, len(p), args.output_len) for p in prompts)
    calibration = calibrate()
    engine_args = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    record = {
        "benchmark": "serve_offline",
        "model": str(model_dir),
        "num_prompts": args.num_prompts,
        "input_len_range": list(args.input_len_range),
        "output_len": args.output_len,
        **machine(),
    }
    print(
        f"{args.num_prompts} requests, {num_prompt_tokens} prompt tokens, {num_output_tokens} output tokens"
    )
    for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        elapsed, times = run_slipstream(model_dir, dtype, prompts, args.output_len, args.repeats, engine_args)
        ours = num_output_tokens / elapsed
        achieved = total_flops / elapsed
        peak = calibration.peak_flops(dtype)
        line = (
            f"{dtype:>8} slipstream: {ours:7.0f} output tok/s, "
            f"{(num_prompt_tokens + num_output_tokens) / elapsed:7.0f} total tok/s, "
            f"{achieved / 1e9:5.0f} GFLOP/s = {100 * achieved / peak:4.1f}% MFU "
            f"(median of {args.repeats}: {', '.join(f'{t:.2f}' for t in times)} s)"
        )
        print(line, flush=True)
        record |= {
            f"{dtype}_output_tok_per_s": ours,
            f"{dtype}_mfu": achieved / peak,
            f"{dtype}_total_tok_per_s": (num_prompt_tokens + num_output_tokens) / elapsed,
        }
        best = None
        for batch_size in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
            hf_elapsed, hf_times = run_transformers(
                model_dir, dtype, prompts, args.output_len, batch_size, args.repeats
            )
            hf = num_output_tokens / hf_elapsed
            print(f"{dtype:>8} transformers batch {batch_size:3d}: {hf:7.0f} output tok/s (median of "
                  f"{args.repeats}: {', '.join(f'{t:.2f}' for t in hf_times)} s)", flush=True)
            best = max(best or 0.0, hf)
        if best:
            print(f"{dtype:>8} ratio slipstream / best transformers: {ours / best:.2f}x")
            record |= {
                f"{dtype}_transformers_output_tok_per_s": best,
                f"{dtype}_ratio_vs_transformers": ours / best,
            }
        if args.vllm_python:
            vllm = run_vllm(
                args.vllm_python, model_dir, dtype, prompts, args.output_len, args.repeats, engine_args
            )
            print(
                f"{dtype:>8} vLLM {vllm['vllm']}: {vllm['output_tok_per_s']:7.0f} output tok/s, "
                f"{vllm['total_tok_per_s']:7.0f} total tok/s (median of {args.repeats}: "
                f"{', '.join(f'{t:.2f}' for t in vllm['times_s'])} s); slipstream / vLLM: "
                f"{ours / vllm['output_tok_per_s']:.2f}x",
                flush=True,
            )
            record |= {
                "vllm": vllm["vllm"],
                f"{dtype}_vllm_output_tok_per_s": vllm["output_tok_per_s"],
                f"{dtype}_vllm_total_tok_per_s": vllm["total_tok_per_s"],
                f"{dtype}_ratio_vs_vllm": ours / vllm["output_tok_per_s"],
            }
    print_json(record)


if __name__ == "__main__":
    main()
