"""Batch-1 decode latency: ms per output token against the memory-bandwidth roofline.

One request (a random prompt of --input-len tokens, --output-len greedy tokens, ignore_eos) runs
through slipstream's engine step by step; the median decode step is the per-token latency. The
floor is the bytes a decode step must read (all weights but the gathered embedding rows, plus the
KV cache; slipstream.perf.flops.decode_bytes_per_step) divided by this machine's read bandwidth,
measured right before and after each repeat (the better of the two: a shared machine's bandwidth
can change twofold from one minute to the next); the share of the roofline is the median of the
repeats' shares. transformers' batch-1 `generate`
on the same prompt is the baseline. Also reports the time from `LLM(...)` to the first token,
after loading the C kernel library, whose load is timed and reported on its own: the first use on
a machine (or after a change to the kernels' source) compiles it, about 2 s on the development
machine, and later processes load the cached build.

    python benchmarks/serve_latency.py                 # ~125M preset, fp32 and bf16

Last line JSON.
"""

from __future__ import annotations

import gc
import time

import torch
from common import ensure_model, machine, median, print_json, random_prompts, serving_parser
from vllm_driver import run_vllm_driver

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.ops import cpu_kernels
from slipstream.perf.flops import decode_bytes_per_step
from slipstream.perf.hardware import measure_memory_bandwidth


def startup_to_first_token_s(model_dir, dtype, prompt):
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype=dtype)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, llm


def decode_step_times_s(llm, prompt, output_len):
    engine = llm.engine
    engine.reset_prefix_cache()  # every repeat prefills the whole prompt
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("latency", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[0], times[1:]  # prefill (first token), then one decode step per token


def transformers_ms_per_token(model_dir, dtype, prompt, output_len):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])

    def run(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        return time.perf_counter() - start

    run(2)  # warm-up
    first = median([run(1) for _ in range(3)])
    full = median([run(output_len) for _ in range(2)])
    return 1e3 * (full - first) / (output_len - 1)


def vllm_latency(vllm_python, model_dir, dtype, prompt, output_len, repeats):
    """vLLM's CPU backend on the same prompt, in a subprocess of its own venv: ms/token from
    (time for output_len tokens - time for 1) / (output_len - 1), and LLM() to first token."""
    return run_vllm_driver(vllm_python, model_dir, dtype, [prompt], output_len, repeats, "latency")


def main() -> None:
    parser = serving_parser(__doc__)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompt = random_prompts(config, 1, args.input_len, args.input_len, seed=0)[0]
    record = {
        "benchmark": "serve_latency",
        "model": str(model_dir),
        "input_len": args.input_len,
        "output_len": args.output_len,
        **machine(),
    }
    start = time.perf_counter()
    cpu_kernels.library()
    record["kernel_library_load_s"] = time.perf_counter() - start
    print(f"C kernel library loaded in {record['kernel_library_load_s']:.2f} s (a build when not cached)")
    for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        startup_s, llm = startup_to_first_token_s(model_dir, dtype, prompt)
        contexts = range(args.input_len + 1, args.input_len + args.output_len)
        bytes_per_step = sum(decode_bytes_per_step(config, dtype, 1, c) for c in contexts) / len(contexts)
        repeats = []  # (first-token s, median decode step s, read bandwidth around the repeat)
        for _ in range(args.repeats):
            bandwidth_before = measure_memory_bandwidth()[0]
            prefill_s, decode_s = decode_step_times_s(llm, prompt, args.output_len)
            bandwidth = max(bandwidth_before, measure_memory_bandwidth()[0])
            step_s = median(decode_s)
            repeats.append((prefill_s, step_s, bandwidth))
            print(f"{dtype:>8} repeat: {1e3 * step_s:6.2f} ms/token at {bandwidth / 1e9:.1f} GB/s = "
                  f"{100 * bytes_per_step / bandwidth / step_s:4.1f}% of bandwidth", flush=True)
        del llm
        gc.collect()
        step_s = median([step for _, step, _ in repeats])
        ttft_s = median([prefill for prefill, _, _ in repeats])
        fraction = median([bytes_per_step / bandwidth / step for _, step, bandwidth in repeats])
        bandwidth = median([bandwidth for _, _, bandwidth in repeats])
        print(
            f"{dtype:>8} slipstream: {1e3 * step_s:6.2f} ms/token, {100 * fraction:4.1f}% of bandwidth "
            f"({bytes_per_step / 1e6:.0f} MB/step; medians of the repeats); prefill of {args.input_len} "
            f"tokens {1e3 * ttft_s:.0f} ms; LLM() to first token {startup_s:.2f} s",
            flush=True,
        )
        record |= {
            f"{dtype}_ms_per_token": 1e3 * step_s,
            f"{dtype}_bandwidth_fraction": fraction,
            f"{dtype}_roofline_ms_per_token": 1e3 * bytes_per_step / bandwidth,
            f"{dtype}_measured_read_gb_per_s": bandwidth / 1e9,
            f"{dtype}_repeats": [
                {"ms_per_token": 1e3 * step, "read_gb_per_s": bandwidth / 1e9,
                 "bandwidth_fraction": bytes_per_step / bandwidth / step}
                for _, step, bandwidth in repeats
            ],
            f"{dtype}_prefill_ms": 1e3 * ttft_s,
            f"{dtype}_startup_to_first_token_s": startup_s,
        }
        if not args.skip_transformers:
            hf_ms = transformers_ms_per_token(model_dir, dtype, prompt, args.output_len)
            print(
                f"{dtype:>8} transformers: {hf_ms:6.2f} ms/token; slipstream is "
                f"{hf_ms / (1e3 * step_s):.2f}x faster",
                flush=True,
            )
            record |= {
                f"{dtype}_transformers_ms_per_token": hf_ms,
                f"{dtype}_speedup_vs_transformers": hf_ms / (1e3 * step_s),
            }
        if args.vllm_python:
            vllm = vllm_latency(args.vllm_python, model_dir, dtype, prompt, args.output_len, args.repeats)
            print(
                f"{dtype:>8} vLLM {vllm['vllm']}: {vllm['ms_per_token']:6.2f} ms/token; prefill of "
                f"{args.input_len} tokens {vllm['prefill_ms']:.0f} ms; LLM() to first token "
                f"{vllm['startup_to_first_token_s']:.2f} s; vLLM ms / slipstream ms: "
                f"{vllm['ms_per_token'] / (1e3 * step_s):.2f}x",
                flush=True,
            )
            record |= {
                "vllm": vllm["vllm"],
                f"{dtype}_vllm_ms_per_token": vllm["ms_per_token"],
                f"{dtype}_vllm_prefill_ms": vllm["prefill_ms"],
                f"{dtype}_vllm_startup_to_first_token_s": vllm["startup_to_first_token_s"],
                f"{dtype}_ratio_vs_vllm": vllm["ms_per_token"] / (1e3 * step_s),
            }
    print_json(record)


if __name__ == "__main__":
    main()
