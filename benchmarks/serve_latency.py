"""Batch-1 decode latency: ms per output token against the memory-bandwidth roofline.

One request (a random prompt of --input-len tokens, --output-len greedy tokens, ignore_eos) runs
through slipstream's engine step by step; the median decode step (per token it produced) is the
per-token latency: with one token per engine step (num_scheduler_steps=1, the engine's and the
server's default), and again with --num-scheduler-steps greedy steps per engine step (multi-step
decoding; 8 is the offline `LLM`'s default), the two in turns
on the same engine, so that both read the same weights from the same memory (two engines of
the same configuration in one process differed by up to 20% on the development VM, each keeping
its speed from repeat to repeat: where its buffers landed). The
floor is the bytes a decode step must read (all weights but the gathered embedding rows, plus the
KV cache; slipstream.perf.flops.decode_bytes_per_step) divided by this machine's read bandwidth,
measured right before and after each repeat (the better of the two); the share of the roofline is
the median of the repeats' shares. A shared machine's bandwidth can change twofold from one
minute to the next, so a repeat whose two measurements differ by more than STEADY_BANDWIDTH
ran at a bandwidth nobody knows: it is printed and kept in the JSON, marked unsteady, but left
out of the medians (unless every repeat was). transformers' batch-1 `generate`
on the same prompt is the baseline. Also reports the time from `LLM(...)` to the first token,
after loading the C kernel library, whose load is timed and reported on its own: the first use on
a machine (or after a change to the kernels' source) compiles it, about 2 s on the development
machine, and later processes load the cached build.

    python benchmarks/serve_latency.py                 # ~125M preset, fp32 and bf16
    python benchmarks/serve_latency.py --quantization int8

With --quantization, an engine with quantized weights runs too, its repeats taking turns with the
unquantized engine's (the baseline, measured in the same run), and its floor counts the bytes the
quantized weights take (decode_bytes_per_step's `quantization`); the ratio printed is the
unquantized engine's ms per token over the quantized one's, the median of the repeats' ratios.

Last line JSON.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch
from common import (
    add_quantization_argument,
    ensure_model,
    machine,
    median,
    print_json,
    random_prompts,
    serving_parser,
)
from vllm_driver import run_vllm_driver

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.ops import cpu_kernels
from slipstream.perf.flops import decode_bytes_per_step
from slipstream.perf.hardware import measure_memory_bandwidth


def startup_to_first_token_s(model_dir, dtype, prompt, quantization=None):
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype=dtype, quantization=quantization)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, llm


def decode_step_times_s(llm, prompt, output_len):
    """(prefill step s, every decode step's time per token it produced)."""
    engine = llm.engine
    engine.reset_prefix_cache()  # every repeat prefills the whole prompt
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("latency", prompt, params)
    times, num_tokens = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        [output] = engine.step()
        elapsed = time.perf_counter() - start
        num_new = len(output.outputs[0].token_ids) - num_tokens
        num_tokens += num_new
        times.append(elapsed / num_new)
    return times[0], times[1:]


STEADY_BANDWIDTH = 0.85
"""A repeat counts when the lower of the bandwidths measured before and after it is at least this
share of the higher."""


def measure(llm, label, prompt, output_len, bytes_per_step, decode_threads=None):
    """One repeat: (prefill s, median decode s per token, read bandwidth around the repeat,
    whether that bandwidth held steady). With `decode_threads` the steps run at that thread count
    and the bandwidth at this process's (serve_tensor_parallel.py: a split engine's share)."""
    threads = torch.get_num_threads()
    before = measure_memory_bandwidth()[0]
    torch.set_num_threads(decode_threads or threads)
    try:
        prefill_s, decode_s = decode_step_times_s(llm, prompt, output_len)
    finally:
        torch.set_num_threads(threads)
    after = measure_memory_bandwidth()[0]
    bandwidth, steady = max(before, after), min(before, after) >= STEADY_BANDWIDTH * max(before, after)
    step_s = median(decode_s)
    unsteady = "" if steady else f" (read {before / 1e9:.1f} GB/s before, {after / 1e9:.1f} after: unsteady)"
    print(f"{label} repeat: {1e3 * step_s:6.2f} ms/token at {bandwidth / 1e9:.1f} GB/s = "
          f"{100 * bytes_per_step / bandwidth / step_s:4.1f}% of bandwidth{unsteady}", flush=True)
    return prefill_s, step_s, bandwidth, steady


def summary(prefix, results, bytes_per_step):
    """The medians of the steady repeats (of all, if none was), as JSON fields under `prefix`."""
    counted = [r for r in results if r[3]] or results
    return {
        f"{prefix}_ms_per_token": 1e3 * median([step for _, step, _, _ in counted]),
        f"{prefix}_bandwidth_fraction": median([bytes_per_step / bandwidth / step
                                                for _, step, bandwidth, _ in counted]),
        f"{prefix}_roofline_ms_per_token": 1e3 * bytes_per_step / median([b for _, _, b, _ in counted]),
        f"{prefix}_measured_read_gb_per_s": median([bandwidth for _, _, bandwidth, _ in counted]) / 1e9,
        f"{prefix}_repeats": [
            {"ms_per_token": 1e3 * step, "read_gb_per_s": bandwidth / 1e9,
             "bandwidth_fraction": bytes_per_step / bandwidth / step, "steady": steady}
            for _, step, bandwidth, steady in results
        ],
    }


def measure_in_turns(engines, args, prompt):
    """Each engine's (one-step repeats, multi-step repeats), `engines` mapping a label to (LLM,
    bytes per decode step): in every repeat each engine measures once per mode, in turn, so that
    all of them meet the same minutes of the machine."""
    results = {label: ([], []) for label in engines}
    for _ in range(args.repeats):
        for label, (llm, bytes_per_step) in engines.items():
            one_step, multi_step = (dataclasses.replace(llm.engine.config, num_scheduler_steps=steps)
                                    for steps in (1, args.num_scheduler_steps))
            llm.engine.config = one_step
            results[label][0].append(measure(llm, f"{label:>8}", prompt, args.output_len, bytes_per_step))
            llm.engine.config = multi_step
            results[label][1].append(measure(llm, f"{label:>8} {args.num_scheduler_steps} steps at once",
                                             prompt, args.output_len, bytes_per_step))
    return results


def quantized_summary(dtype, quantization, results, bytes_per_step, startup_s, num_scheduler_steps):
    """The quantized engine's JSON fields and its ratio to the unquantized one (the median over
    repeats of unquantized ms / quantized ms, one-step and multi-step), printed."""
    prefix = f"{dtype}_{quantization}"
    record = summary(prefix, results[prefix][0], bytes_per_step)
    record |= summary(f"{prefix}_multi_step", results[prefix][1], bytes_per_step)
    record[f"{prefix}_startup_to_first_token_s"] = startup_s
    record[f"{prefix}_prefill_ms"] = 1e3 * median([prefill for prefill, *_ in results[prefix][0]])
    for mode, index in (("", 0), ("_multi_step", 1)):
        pairs = zip(results[dtype][index], results[prefix][index], strict=True)
        record[f"{prefix}{mode}_speedup_vs_unquantized"] = median([base[1] / ours[1] for base, ours in pairs])
    print(
        f"{dtype:>8} slipstream {quantization}: {record[f'{prefix}_ms_per_token']:6.2f} ms/token, "
        f"{100 * record[f'{prefix}_bandwidth_fraction']:4.1f}% of bandwidth ({bytes_per_step / 1e6:.0f} "
        f"MB/step), {record[f'{prefix}_speedup_vs_unquantized']:.2f}x the unquantized engine; "
        f"num_scheduler_steps={num_scheduler_steps}: "
        f"{record[f'{prefix}_multi_step_ms_per_token']:6.2f} ms/token, "
        f"{record[f'{prefix}_multi_step_speedup_vs_unquantized']:.2f}x; prefill "
        f"{record[f'{prefix}_prefill_ms']:.0f} ms; LLM() to first token {startup_s:.2f} s",
        flush=True,
    )
    return record


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
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="greedy steps per engine step for the multi-step measurement")
    add_quantization_argument(parser)
    args = parser.parse_args()

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompt = random_prompts(config, 1, args.input_len, args.input_len, seed=0)[0]
    record = {
        "benchmark": "serve_latency",
        "model": str(model_dir),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_scheduler_steps": args.num_scheduler_steps,
        **machine(),
    }
    if args.quantization is not None:
        record["quantization"] = args.quantization
    start = time.perf_counter()
    cpu_kernels.library()
    record["kernel_library_load_s"] = time.perf_counter() - start
    print(f"C kernel library loaded in {record['kernel_library_load_s']:.2f} s (a build when not cached)")
    for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        contexts = range(args.input_len + 1, args.input_len + args.output_len)
        engines, startups, step_bytes = {}, {}, {}
        for quantization in [None] if args.quantization is None else [None, args.quantization]:
            label = dtype if quantization is None else f"{dtype}_{quantization}"
            startups[label], llm = startup_to_first_token_s(model_dir, dtype, prompt, quantization)
            step_bytes[label] = sum(decode_bytes_per_step(config, dtype, 1, c, quantization=quantization)
                                    for c in contexts) / len(contexts)
            engines[label] = (llm, step_bytes[label])
        results = measure_in_turns(engines, args, prompt)
        del llm, engines
        gc.collect()
        repeats, multi_steps = results[dtype]
        startup_s, bytes_per_step = startups[dtype], step_bytes[dtype]
        record |= summary(dtype, repeats, bytes_per_step)
        record |= {f"{dtype}_prefill_ms": 1e3 * median([prefill for prefill, *_ in repeats]),
                   f"{dtype}_startup_to_first_token_s": startup_s}
        record |= summary(f"{dtype}_multi_step", multi_steps, bytes_per_step)
        step_s = record[f"{dtype}_ms_per_token"] / 1e3
        print(
            f"{dtype:>8} slipstream: {1e3 * step_s:6.2f} ms/token, "
            f"{100 * record[f'{dtype}_bandwidth_fraction']:4.1f}% of bandwidth "
            f"({bytes_per_step / 1e6:.0f} MB/step; medians of the steady repeats); prefill of "
            f"{args.input_len} tokens {record[f'{dtype}_prefill_ms']:.0f} ms; LLM() to first token "
            f"{startup_s:.2f} s",
            flush=True,
        )
        print(
            f"{dtype:>8} slipstream, num_scheduler_steps={args.num_scheduler_steps}: "
            f"{record[f'{dtype}_multi_step_ms_per_token']:6.2f} ms/token, "
            f"{100 * record[f'{dtype}_multi_step_bandwidth_fraction']:4.1f}% of bandwidth",
            flush=True,
        )
        if args.quantization is not None:
            label = f"{dtype}_{args.quantization}"
            record |= quantized_summary(dtype, args.quantization, results, step_bytes[label], startups[label],
                                        args.num_scheduler_steps)
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
