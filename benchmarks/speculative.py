"""N-gram speculative decoding against plain greedy decoding, in the same run.

The same greedy requests (random prompts of --input-len tokens, --output-len tokens each,
ignore_eos) run without `speculative_config`, with it (ngram, --num-speculative-tokens guesses)
and with it and disable_by_batch_size 4 ("ngram4"), in alternating repeats on one engine whose
configuration is swapped between them (so that all read the same weights from the same memory:
two engines of one configuration in one process differ by up to 20% here, see
serve_latency.py); the outputs must be identical. Per configuration: the median decode time per
output token (decode steps only: the prefill step is left out), tokens per decode step, the share
of guesses the model confirmed, and the share of the bandwidth floor (the bytes one plain decode
step of the batch reads, slipstream.perf.flops.decode_bytes_per_step, over the median of the read
bandwidths measured before every repeat, per token) that the time per token reaches: above 100% is
faster than any one-token-per-step decoder can be. The machine's bandwidth wanders from minute to
minute, so the ratio between configurations, measured in turns, is the number to read.

How many guesses the model confirms depends on how much its output repeats its context. The
default model is the small preset with random weights, whose greedy output falls into short loops,
which n-gram guesses predict well: the upper end of the gain. A trained model on text that does not
repeat itself confirms few, and then pays for the guesses it checks in vain; the printed share of
confirmed guesses says where a run stands.

    python benchmarks/speculative.py                      # small preset, fp32, batch 1 and 8

Last line JSON.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from common import ensure_model, machine, median, model_parser, print_json, random_prompts

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.perf.flops import decode_bytes_per_step
from slipstream.perf.hardware import measure_memory_bandwidth


def decode_time_per_token(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float, list]:
    """(decode seconds per output token, output tokens per decode step, the outputs' token ids)."""
    engine = llm.engine
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, stream=False)
    decode_s, num_steps, outputs, first = 0.0, 0, {}, True
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        finished = engine.step()
        elapsed = time.perf_counter() - start
        if not first:
            decode_s += elapsed
            num_steps += 1
        first = False
        outputs.update({o.request_id: o.outputs[0].token_ids for o in finished})
    num_decode_tokens = len(prompts) * (output_len - 1)
    in_order = [outputs[str(i)] for i in range(len(prompts))]
    return decode_s / num_decode_tokens, num_decode_tokens / max(num_steps, 1), in_order


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()

    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4}
    record = {"benchmark": "speculative", "model": str(model_dir), "dtype": args.dtype, "machine": machine(),
              "num_speculative_tokens": args.num_speculative_tokens, "results": []}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        prompts = random_prompts(config, batch_size, args.input_len, args.input_len, seed=batch_size)
        llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=batch_size)
        plain = llm.engine.config
        configs = {"plain": plain,
                   "ngram": dataclasses.replace(plain, speculative_config=spec),
                   "ngram4": dataclasses.replace(plain,
                                                 speculative_config=spec | {"disable_by_batch_size": 4})}
        runs = {name: [] for name in configs}
        outputs = {}
        for _ in range(args.repeats):
            for name, engine_config in configs.items():
                llm.engine.config = engine_config
                bandwidth = measure_memory_bandwidth()[0]
                before = (llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens)
                per_token, per_step, outputs[name] = decode_time_per_token(llm, prompts, args.output_len)
                drafts = llm.engine.num_draft_tokens - before[0]
                accepted = llm.engine.num_accepted_tokens - before[1]
                runs[name].append((per_token, per_step, bandwidth, accepted / drafts if drafts else 0.0))
        assert outputs["plain"] == outputs["ngram"] == outputs["ngram4"], "speculation changed the output"
        context = args.input_len + args.output_len // 2
        floor_bytes = decode_bytes_per_step(config, dtype, batch_size, context)
        result = {"batch_size": batch_size}
        bandwidth = median([v[2] for values in runs.values() for v in values])  # one for all three
        for name, values in runs.items():
            per_token = median([v[0] for v in values])
            floor_s = floor_bytes / bandwidth / batch_size
            result[name] = {"ms_per_token": per_token * 1e3,
                            "tokens_per_step": median([v[1] for v in values]),
                            "accepted_share": median([v[3] for v in values]),
                            "roofline_share": floor_s / per_token}
            print(f"batch {batch_size:3d} {name:6s} {per_token * 1e3:7.2f} ms/token  "
                  f"{result[name]['tokens_per_step']:.2f} tokens/step  "
                  f"{result[name]['accepted_share']:.0%} of guesses confirmed  "
                  f"{result[name]['roofline_share']:.0%} of the one-token-per-step floor")
        for name in ("ngram", "ngram4"):
            result[f"speedup_{name}"] = result["plain"]["ms_per_token"] / result[name]["ms_per_token"]
            print(f"batch {batch_size:3d} {name} / plain: {result[f'speedup_{name}']:.2f}x")
        record["results"].append(result)
    print_json(record)


if __name__ == "__main__":
    main()
