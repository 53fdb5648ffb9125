"""Offline serving throughput: slipstream's LLM.generate against transformers' batched generate.

Workload (deterministic): N requests of random token ids with prompt lengths uniform in a range,
a fixed number of output tokens with ignore_eos, greedy. Slipstream gets all requests at once;
transformers runs left-padded greedy `generate` in batches, at each batch size given, and its
best batch size is the baseline. Slipstream and transformers run in this process on the same
model and dtype, vLLM in its own venv (a driver process kept up between runs). Every engine is
built and warmed once, then the engines take turns, one timed run each per round, for --repeats
rounds: a shared machine's speed drifts over the tens of minutes a benchmark takes, and this way
every round compares the engines within the same few minutes. Each engine's time is the median
of its rounds; each ratio is the median of the per-round ratios.

    python benchmarks/serve_offline.py                       # ~125M preset, fp32 and bf16
    python benchmarks/serve_offline.py --dtype bfloat16 --hf-batch-sizes 16,64
    python benchmarks/serve_offline.py --quantization int8   # and int8 weights against unquantized
    python benchmarks/serve_offline.py --kv-cache-dtype fp8  # and an fp8 KV cache against the model's dtype

With --quantization, a second slipstream engine with quantized weights takes its turn in every
round too; its ratio is to the unquantized engine (the baseline of the same rounds), the median of
the per-round ratios, and its MFU counts the same FLOPs (weight-only quantization changes bytes).
--kv-cache-dtype does the same for an engine whose KV cache is in that dtype (vLLM's
kv_cache_dtype), its ratio to the engine whose cache is in the model's dtype.

Prints output tok/s, total (prompt + output) tok/s, the ratio to transformers, and MFU against
the calibrated peak (model FLOPs from slipstream.perf.flops.generation_flops); last line JSON.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable

import torch
from common import (
    add_quantization_argument,
    ensure_model,
    machine,
    median,
    print_json,
    random_prompts,
    serving_parser,
    warn_above_peak,
)
from vllm_driver import OfflineRounds

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.ops.kv_cache_dtypes import KV_CACHE_DTYPE_NAMES
from slipstream.perf.flops import generation_flops
from slipstream.perf.hardware import calibrate

PAUSE_S = 1.0
"""Idle time before each timed run, so that the threads of the engine that ran before (OpenMP
workers spin for a while after their last parallel region) are asleep when the next one starts."""


def slipstream_runner(model_dir, dtype, prompts, output_len, engine_args) -> Callable[[], float]:
    """slipstream's LLM, built and warmed up; the returned call times one run of every prompt."""
    llm = LLM(str(model_dir), dtype=dtype, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    def run() -> float:
        llm.reset_prefix_cache()  # every run computes every prompt: same prompts, cold cache
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        return elapsed

    return run


def load_transformers(model_dir, dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if getattr(model.config, "output_router_logits", False):
        # A training switch (the load-balancing loss), which generate would compute at every step
        # and, on left-padded batches, fail in (transformers 5.25's load_balancing_loss_func).
        model.config.output_router_logits = False
    return model


def _transformers_once(model, prompts, output_len, batch_size) -> float:
    """Seconds of one run of every prompt, `batch_size` at a time."""
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


def vllm_rounds(vllm_python, model_dir, dtype, prompts, output_len, engine_args) -> OfflineRounds:
    """vLLM's CPU backend on the same prompts and engine limits, up and warm in its own venv's
    process, one timed run per call of `run`."""
    return OfflineRounds(
        vllm_python, model_dir, dtype, prompts, output_len,
        ["--max-num-seqs", str(engine_args["max_num_seqs"]),
         "--max-num-batched-tokens", str(engine_args["max_num_batched_tokens"])],
    )


def run_rounds(runners: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each runner's seconds over `repeats` rounds of one run per runner, in turn."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            time.sleep(PAUSE_S)
            times[name].append(run())
    return times


def ratio_to(tok_per_s: dict[str, list[float]], name: str, ours: str = "slipstream") -> float:
    """The median over rounds of `ours`' throughput over `name`'s in the same round."""
    pairs = zip(tok_per_s[ours], tok_per_s[name], strict=True)
    return median([ours / theirs for ours, theirs in pairs])


def quantized_summary(dtype, name, tok_per_s, times, peak_seconds, num_tokens, repeats) -> dict:
    """The quantized engine's JSON fields, printed: its throughput, MFU (the same FLOPs over its
    time; `peak_seconds` is the run's FLOPs over the peak) and its ratio to the unquantized engine."""
    elapsed = median(times[name])
    key = f"{dtype}_{name.removeprefix('slipstream ')}"
    fields = {
        f"{key}_output_tok_per_s": median(tok_per_s[name]),
        f"{key}_total_tok_per_s": num_tokens / elapsed,
        f"{key}_mfu": peak_seconds / elapsed,
        f"{key}_speedup_vs_unquantized": ratio_to(tok_per_s, "slipstream", ours=name),
    }
    print(f"{dtype:>8} {name}: {fields[f'{key}_output_tok_per_s']:7.0f} output tok/s, "
          f"{fields[f'{key}_total_tok_per_s']:7.0f} total tok/s, {100 * fields[f'{key}_mfu']:4.1f}% MFU, "
          f"{fields[f'{key}_speedup_vs_unquantized']:.2f}x the unquantized engine (median of {repeats} "
          f"rounds: {_listed(times[name])} s; ratio: median of the rounds' ratios)", flush=True)
    return fields


def _listed(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> None:
    parser = serving_parser(__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--hf-batch-sizes", default="16,64", help="comma-separated; empty skips transformers")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    add_quantization_argument(parser)
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPE_NAMES),
                        help="also serve with the KV cache in this dtype and print its ratio to the "
                             "engine whose cache is in the model's dtype")
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
    if args.quantization is not None:
        record["quantization"] = args.quantization
    print(
        f"{args.num_prompts} requests, {num_prompt_tokens} prompt tokens, {num_output_tokens} output tokens"
    )
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        with contextlib.ExitStack() as stack:
            # vLLM first: its start-up (minutes here) runs alone, before anything is timed.
            vllm = (stack.enter_context(vllm_rounds(args.vllm_python, model_dir, dtype, prompts,
                                                    args.output_len, engine_args))
                    if args.vllm_python else None)
            ours_run = slipstream_runner(model_dir, dtype, prompts, args.output_len, engine_args)
            runners = {"slipstream": ours_run}
            quantized = f"slipstream {args.quantization}"
            if args.quantization is not None:
                runners[quantized] = slipstream_runner(model_dir, dtype, prompts, args.output_len,
                                                       engine_args | {"quantization": args.quantization})
            if args.kv_cache_dtype is not None:
                kv_engine = f"slipstream kv {args.kv_cache_dtype}"
                runners[kv_engine] = slipstream_runner(model_dir, dtype, prompts, args.output_len,
                                                       engine_args | {"kv_cache_dtype": args.kv_cache_dtype})
            hf_model = load_transformers(model_dir, dtype) if batch_sizes else None
            for batch_size in batch_sizes:
                runners[f"transformers batch {batch_size}"] = functools.partial(
                    _transformers_once, hf_model, prompts, args.output_len, batch_size)
            if vllm is not None:
                runners["vllm"] = vllm.run
            times = run_rounds(runners, args.repeats)
            version = vllm.close()["vllm"] if vllm is not None else None
            del runners, ours_run, hf_model
        gc.collect()

        tok_per_s = {name: [num_output_tokens / t for t in ts] for name, ts in times.items()}
        ours = median(tok_per_s["slipstream"])
        elapsed = median(times["slipstream"])
        achieved = total_flops / elapsed
        peak = calibration.peak_flops(dtype)
        print(
            f"{dtype:>8} slipstream: {ours:7.0f} output tok/s, "
            f"{(num_prompt_tokens + num_output_tokens) / elapsed:7.0f} total tok/s, "
            f"{achieved / 1e9:5.0f} GFLOP/s = {100 * achieved / peak:4.1f}% MFU "
            f"(median of {args.repeats} rounds: {_listed(times['slipstream'])} s)",
            flush=True,
        )
        warn_above_peak(achieved, peak, f"{dtype} slipstream")
        record |= {
            f"{dtype}_output_tok_per_s": ours,
            f"{dtype}_mfu": achieved / peak,
            f"{dtype}_total_tok_per_s": (num_prompt_tokens + num_output_tokens) / elapsed,
            f"{dtype}_times_s": times,
        }
        if args.quantization is not None:
            record |= quantized_summary(dtype, quantized, tok_per_s, times, total_flops / peak,
                                        num_prompt_tokens + num_output_tokens, args.repeats)

        if args.kv_cache_dtype is not None:
            ratio = ratio_to(tok_per_s, "slipstream", ours=kv_engine)
            print(f"{dtype:>8} {kv_engine}: {median(tok_per_s[kv_engine]):7.0f} output tok/s (median of "
                  f"{args.repeats} rounds: {_listed(times[kv_engine])} s), {ratio:.2f}x the model-dtype "
                  f"cache (median of the rounds' ratios)", flush=True)
            record |= {f"{dtype}_kv_{args.kv_cache_dtype}_output_tok_per_s": median(tok_per_s[kv_engine]),
                       f"{dtype}_kv_{args.kv_cache_dtype}_ratio": ratio}

        if batch_sizes:
            for batch_size in batch_sizes:
                name = f"transformers batch {batch_size}"
                print(f"{dtype:>8} {name:>22}: {median(tok_per_s[name]):7.0f} output tok/s (median of "
                      f"{args.repeats} rounds: {_listed(times[name])} s)", flush=True)
            best = max((f"transformers batch {b}" for b in batch_sizes), key=lambda n: median(tok_per_s[n]))
            print(f"{dtype:>8} ratio slipstream / best transformers ({best}): "
                  f"{ratio_to(tok_per_s, best):.2f}x (median of the rounds' ratios)")
            record |= {
                f"{dtype}_transformers_output_tok_per_s": median(tok_per_s[best]),
                f"{dtype}_ratio_vs_transformers": ratio_to(tok_per_s, best),
            }
        if vllm is not None:
            theirs = median(tok_per_s["vllm"])
            theirs_total = (num_prompt_tokens + num_output_tokens) / median(times["vllm"])
            print(
                f"{dtype:>8} vLLM {version}: {theirs:7.0f} output tok/s, "
                f"{theirs_total:7.0f} total tok/s "
                f"(median of {args.repeats} rounds: {_listed(times['vllm'])} s); slipstream / vLLM: "
                f"{ratio_to(tok_per_s, 'vllm'):.2f}x (median of the rounds' ratios)",
                flush=True,
            )
            record |= {
                "vllm": version,
                f"{dtype}_vllm_output_tok_per_s": theirs,
                f"{dtype}_vllm_total_tok_per_s": theirs_total,
                f"{dtype}_ratio_vs_vllm": ratio_to(tok_per_s, "vllm"),
            }
    print_json(record)


if __name__ == "__main__":
    main()
