"""The hybrid KV cache manager against every layer keeping every block, under a KV budget that binds.

Workload (deterministic): a random Gemma-3-shaped model created once under runs/bench (six layers,
five with a sliding window of 128 tokens to one global, head size 64), N prompts of random token
ids with lengths uniform in a range (long against the window), a fixed number of output tokens
with ignore_eos, greedy. Both engines get the same `kv_cache_memory` (default: the bytes of 4 of the
longest sequences with every block kept) and all requests at once; one runs with the hybrid KV
cache manager (windowed layers give back the blocks their window passed), the other with
`disable_hybrid_kv_cache_manager=True`. They are built and warmed once, then take turns, one timed
run each per round, for --repeats rounds; each engine's figure is the median of its rounds, the
ratio the median of the per-round ratios. The machine's other work can slow a round several times
over (OpenMP threads of two processes on the same cores), so each engine's fastest round is
printed too.

    python benchmarks/serve_hybrid_kv.py
    python benchmarks/serve_hybrid_kv.py --num-prompts 32 --input-len-range 1024 2048 --output-len 64

Prints, per engine: output tok/s, peak concurrent sequences, the most KV blocks and KV bytes one
sequence held between steps (sampled after each step, so after its windows' release: within a step
a sliding group holds up to its window plus the step's chunk, a block or a chunk's more), and
preemptions; then the ratio. Last line JSON.
"""

from __future__ import annotations

import time

import torch
from common import BENCH_MODELS_DIR, machine, median, model_parser, print_json, random_prompts

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig

PAUSE_S = 1.0
"""Idle time before each timed run (OpenMP workers of the engine before spin a while)."""
WINDOW = 128
MODEL_NAME = "hybrid-gemma3"


def ensure_hybrid_model() -> str:
    """A random Gemma 3 text model, transformers' own class, with a tokenizer, created once."""
    path = BENCH_MODELS_DIR / MODEL_NAME
    if not (path / "config.json").is_file():
        import transformers

        from slipstream.model.create import stdlib_tokenizer

        torch.manual_seed(0)
        config = transformers.Gemma3TextConfig(
            vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            sliding_window=WINDOW, sliding_window_pattern=6, query_pre_attn_scalar=64)
        transformers.Gemma3ForCausalLM(config).eval().save_pretrained(path)
        stdlib_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


class Run:
    """One engine, built and warmed up; `__call__` times one run of every prompt, stepping the
    engine itself to see how many sequences run at once and what each holds."""

    def __init__(self, model_dir: str, prompts: list[list[int]], output_len: int, **engine_args) -> None:
        self.llm = LLM(model_dir, dtype="float32", **engine_args)
        self.prompts, self.output_len = prompts, output_len
        self.llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        self.peak_running = self.peak_blocks_per_seq = 0

    def __call__(self) -> float:
        engine = self.llm.engine
        self.llm.reset_prefix_cache()  # every run computes every prompt
        preemptions_before = engine.scheduler.num_preemptions
        params = SamplingParams(temperature=0.0, max_tokens=self.output_len, ignore_eos=True)
        ids = [f"run-{time.perf_counter_ns()}-{i}" for i in range(len(self.prompts))]
        start = time.perf_counter()
        for request_id, prompt in zip(ids, self.prompts, strict=True):
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            self.peak_running = max(self.peak_running, engine.scheduler.num_running)
            self.peak_blocks_per_seq = max(self.peak_blocks_per_seq,
                                           *(engine.num_kv_blocks_held(request_id) for request_id in ids))
        elapsed = time.perf_counter() - start
        self.preemptions = engine.scheduler.num_preemptions - preemptions_before
        return elapsed

    @property
    def bytes_per_block(self) -> int:
        cache = self.llm.engine.runner.cache
        return sum(pages[0].numel() * pages.element_size() for pages in (*cache.keys, *cache.values))


def main() -> None:
    parser = model_parser(__doc__, output_len=192)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(512, 1024))
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int,
                        help="bytes (default: 4 of the longest sequences with every block kept)")
    args = parser.parse_args()
    model_dir = args.model or ensure_hybrid_model()
    config = ModelConfig.from_pretrained(model_dir)
    prompts = random_prompts(config, args.num_prompts, *args.input_len_range, seed=0)
    longest = args.input_len_range[1] + args.output_len
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # fp32
    memory = args.kv_cache_memory or 4 * -(-longest // args.block_size) * args.block_size * per_token
    engine_args = dict(kv_cache_memory=memory, max_model_len=longest, block_size=args.block_size,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_prompts)
    runs = {"hybrid": Run(model_dir, prompts, args.output_len, **engine_args),
            "disabled": Run(model_dir, prompts, args.output_len, disable_hybrid_kv_cache_manager=True,
                            **engine_args)}
    print(f"model {model_dir}: {runs['hybrid'].llm.engine.limits.kv_groups.describe()}; "
          f"kv_cache_memory {memory / 2**20:.1f} MiB; {args.num_prompts} prompts of "
          f"{args.input_len_range[0]}-{args.input_len_range[1]} tokens, {args.output_len} output tokens",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            times[name].append(run())
    num_output = args.num_prompts * args.output_len
    record = {"model": MODEL_NAME if args.model is None else model_dir, "kv_cache_memory": memory,
              "num_prompts": args.num_prompts, "input_len_range": list(args.input_len_range),
              "output_len": args.output_len, "repeats": args.repeats, "machine": machine()}
    for name, run in runs.items():
        tok_per_s = median([num_output / t for t in times[name]])
        blocks = run.llm.engine.limits.num_blocks
        record |= {f"{name}_output_tok_per_s": tok_per_s, f"{name}_times_s": times[name],
                   f"{name}_best_output_tok_per_s": num_output / min(times[name]),
                   f"{name}_peak_running": run.peak_running,
                   f"{name}_kv_blocks_per_seq": run.peak_blocks_per_seq,
                   f"{name}_kv_bytes_per_seq": run.peak_blocks_per_seq * run.bytes_per_block,
                   f"{name}_num_blocks": blocks, f"{name}_preemptions_last_round": run.preemptions}
        rounds = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:>8}: {tok_per_s:7.1f} output tok/s (rounds {rounds} s), "
              f"peak {run.peak_running} sequences at once, at most {run.peak_blocks_per_seq} of {blocks} "
              f"blocks ({run.peak_blocks_per_seq * run.bytes_per_block / 2**20:.1f} MiB) per sequence "
              "between steps, "
              f"{run.preemptions} preemptions in the last round", flush=True)
    ratio = median([d / h for h, d in zip(times["hybrid"], times["disabled"], strict=True)])
    record["hybrid_speedup"] = ratio
    print(f"hybrid / disabled output tok/s: {ratio:.2f}x (median of {args.repeats} rounds' ratios)")
    print_json(record)


if __name__ == "__main__":
    main()
