"""What structured outputs cost, against the same work without them, in the same run.

1. The guide's one-time work on the bench model's tokenizer (32,000 tokens): the byte trie of the
   vocabulary (once per engine), and the walk that finds a state's allowed tokens (once per
   state) for a choice, a JSON schema and json_object, at states where few tokens fit and where
   almost all do (inside a JSON string).
2. The sampler's per-step masking of 64 guided rows of 16,000 allowed tokens each: the guide's
   int64 arrays, read without a copy, against the same ids as Python lists.
3. End to end: --num-requests greedy requests of --output-len tokens under a JSON schema (small
   values, so that outputs end) and under a GBNF grammar of the same shape (llguidance's parser
   instead of the byte automaton), against the same requests unconstrained, on one engine in
   turns: output tokens/s of each and the ratios. The model is the small preset with random
   weights.

    python benchmarks/structured_outputs.py

Last line JSON.
"""

from __future__ import annotations

import array
import time

import torch
from common import ensure_model, machine, median, model_parser, print_json, random_prompts

from slipstream import LLM, SamplingParams, StructuredOutputsParams
from slipstream.model import ModelConfig
from slipstream.serve.fsm import ByteDFA
from slipstream.serve.json_schema import json_object_regex, schema_regex
from slipstream.serve.request import SamplingParams as Params
from slipstream.serve.sampler import SamplingBatch, SamplingRow
from slipstream.serve.structured import Guide

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}
GRAMMAR = r'''root ::= "{\"name\": \"" [a-zA-Z ]{1,12} "\", \"age\": " age ", \"ok\": " ok "}"
age ::= [0-9]{1,3}
ok ::= "true" | "false"'''


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def guide_costs(llm: LLM) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    vocabulary = engine._vocabulary
    costs = {"vocabulary_s": time.perf_counter() - start, "walks_ms": {}}
    for name, pattern, prefix in (("choice", "positive|negative|neutral", b"pos"),
                                  ("schema", schema_regex(SCHEMA), b'{"name": "Bo'),
                                  ("json_object", json_object_regex(), b'{"a": "x')):
        dfa = ByteDFA(pattern)
        walks = []
        for cut in (0, len(prefix)):  # the start state, then a state after the prefix
            state = dfa.start
            for byte in prefix[:cut]:
                state = dfa.step(state, byte)
            guide = Guide(dfa, vocabulary, [0])
            start = time.perf_counter()
            allowed = guide.allowed_token_ids(state)
            walks.append((time.perf_counter() - start) * 1e3)
            print(f"  {name:12s} after {prefix[:cut]!r:16s} {walks[-1]:7.1f} ms  "
                  f"{len(allowed):6d} tokens allowed")
        costs["walks_ms"][name] = walks
    return costs


def masking_costs(vocab_size: int) -> dict:
    structured = StructuredOutputsParams(choice=["a"])
    ids = list(range(0, vocab_size, 2))
    results = {}
    for name, allowed in (("array", array.array("q", ids)), ("list", ids)):
        rows = [SamplingRow(Params(temperature=0.0, structured_outputs=structured), output_token_ids=[1],
                            allowed_token_ids=allowed) for _ in range(64)]
        results[name] = timed(lambda rows=rows: SamplingBatch.build(rows, vocab_size=vocab_size,
                                                                    device="cpu"))
        print(f"  masking 64 rows from {name:5s}: {results[name] * 1e3:7.2f} ms")
    results["ratio"] = results["list"] / results["array"]
    return results


def end_to_end(llm: LLM, prompts: list[list[int]], output_len: int, repeats: int) -> dict:
    plain = SamplingParams(temperature=0, max_tokens=output_len)
    runs = {"plain": plain, "schema": plain.replace(structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            "grammar": plain.replace(structured_outputs=StructuredOutputsParams(grammar=GRAMMAR))}
    rates = {name: [] for name in runs}
    for _ in range(repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    result = {name: median(values) for name, values in rates.items()}
    for name in runs:
        print(f"  {name:7s} {result[name]:8.1f} output tokens/s")
    for name in ("schema", "grammar"):
        result[f"{name}_ratio"] = result[name] / result["plain"]
        print(f"  {name} / plain: {result[f'{name}_ratio']:.2f}")
    return result


def main() -> None:
    parser = model_parser(__doc__, output_len=64)
    parser.add_argument("--num-requests", type=int, default=16)
    args = parser.parse_args()
    model_dir = ensure_model(args.model)
    config = ModelConfig.from_pretrained(model_dir)
    llm = LLM(str(model_dir), max_num_seqs=args.num_requests)
    print("guide (once per engine, then once per state):")
    record = {"benchmark": "structured_outputs", "model": str(model_dir), "machine": machine(),
              "guide": guide_costs(llm)}
    print("sampler masking per step:")
    record["masking_s"] = masking_costs(config.vocab_size)
    print(f"{args.num_requests} requests of {args.output_len} tokens, greedy:")
    prompts = random_prompts(config, args.num_requests, 32, 64, seed=0)
    record["end_to_end"] = end_to_end(llm, prompts, args.output_len, args.repeats)
    record["threads"] = torch.get_num_threads()
    print_json(record)


if __name__ == "__main__":
    main()
