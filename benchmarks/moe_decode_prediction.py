"""Mixture-of-experts decode on this CPU: the serving model's predicted step against the engine's.

For each MoE shape, dtype and batch, `--batch` random prompts of --input-len tokens decode greedily
(ignore_eos) through slipstream's engine, one token per engine step (num_scheduler_steps=1), and
the median decode step is set beside `slipstream.perf.serving.step_time` on the calibrated CPU
(`perf serve --hardware cpu`) at the mean context of those steps. Each repeat is a fresh batch on
the same engine; the report gives every repeat's median and the median of them, and the fastest
step seen and the first quartile of the steps (a shared machine's other work only ever adds
time). The read bandwidth is measured before and after each batch's repeats (the better of the
two), and the step predicted again at it: a shared machine's bandwidth drifts from minute to
minute, well below the calibration's at times. The shapes: the tiny-moe preset
(Mixtral: hidden 384, 6 layers, 8 experts of 512, top 2), a larger Mixtral (hidden 768, 8 layers,
8 experts of 1024), and with --skeleton one whose every width is small (hidden 64, 8 experts of
64, vocabulary 512): its step is almost all fixed cost, the per-call and per-step overheads.

--ops prints the aten ops of one engine decode step by name (torch profiler), as the tests count
them against the model's priced ops. --module-by-module switches the runner's decode graph off
where it has one (a line says "decode graph" where a step could replay it).

    python benchmarks/moe_decode_prediction.py --batch 1,16,64 --dtype both

Last line JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from pathlib import Path

import torch
from common import BENCH_MODELS_DIR, machine, median, print_json

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.model.create import stdlib_tokenizer
from slipstream.model.presets import get_preset
from slipstream.model.transformer import Transformer
from slipstream.model.weights import new_model_dir, save_model
from slipstream.perf import serving
from slipstream.perf.accelerators import Accelerator
from slipstream.perf.hardware import get_accelerator, measure_memory_bandwidth
from slipstream.perf.shapes import TransformerShape

SHAPES = {
    "tiny-moe": {},
    "mixtral-768": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                        intermediate_size=1024),
    "skeleton-2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=512),
    "skeleton-12": dict(hidden_size=64, num_hidden_layers=12, num_attention_heads=1, num_key_value_heads=1,
                        intermediate_size=64, vocab_size=512),
}
"""Changes to the tiny-moe preset's config (Mixtral's routed experts are intermediate_size wide)."""


def ensure_moe_model(name: str) -> Path:
    """The model directory of shape `name`, created once under BENCH_MODELS_DIR."""
    out = BENCH_MODELS_DIR / f"moe-{name}"
    if (out / "config.json").exists():
        return out
    tokenizer = stdlib_tokenizer(SHAPES[name].get("vocab_size", get_preset("tiny-moe").config.vocab_size))
    config = get_preset("tiny-moe").config.replace(**SHAPES[name], eos_token_id=tokenizer.eos_token_id,
                                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with new_model_dir(out) as staging:
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device="cpu")
        model.init_weights(generator=torch.Generator().manual_seed(0))
        save_model(model, staging, dtype="float32")
        tokenizer.save_pretrained(staging)
    return out


def _at_bandwidth(accelerator: Accelerator, bandwidth: float) -> Accelerator:
    """`accelerator` with its memory read at `bandwidth` and its cache curve scaled alike."""
    scale = bandwidth / accelerator.memory_bandwidth_bytes_per_s
    return dataclasses.replace(accelerator, memory_bandwidth_bytes_per_s=bandwidth, cache_read_bytes_per_s={
        size: rate * scale for size, rate in accelerator.cache_read_bytes_per_s.items()})


def decode_steps_s(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Every decode step's seconds (the first step, the prefill, left out)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{time.perf_counter_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def step_ops(llm: LLM, prompts: list[list[int]]) -> collections.Counter:
    """The aten ops of one decode step, by name."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ops-{i}", prompt, params)
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return collections.Counter(e.name for e in profile.events() if e.name.startswith("aten::"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny-moe,mixtral-768", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", action="store_true", help="print one decode step's aten ops")
    parser.add_argument("--module-by-module", action="store_true",
                        help="switch the runner's decode graph off: every step module by module")
    args = parser.parse_args()
    accelerator = get_accelerator("cpu")
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    batches = [int(b) for b in args.batch.split(",")]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        model_dir = ensure_moe_model(name)
        shape = TransformerShape.from_model_config(ModelConfig.from_pretrained(model_dir))
        for dtype in dtypes:
            llm = LLM(str(model_dir), dtype=dtype, num_scheduler_steps=1)
            if args.module_by_module:
                llm.engine.runner.decode_graph = None
            graph = llm.engine.runner.decode_graph is not None
            graph_seqs = llm.engine.runner.decode_graph.max_seqs if graph else 0
            setup = serving.ServeSetup(shape=shape, dtype=dtype, decode_graph_max_batch=graph_seqs)
            for batch in batches:
                prompts = [torch.randint(0, shape.vocab_size, (args.input_len,), generator=generator).tolist()
                           for _ in range(batch)]
                decode_steps_s(llm, prompts, 4)  # warm-up: the shapes' first calls
                before = measure_memory_bandwidth()[0]
                repeats = [decode_steps_s(llm, prompts, args.output_len) for _ in range(args.repeats)]
                bandwidth = max(before, measure_memory_bandwidth()[0])
                context = args.input_len + args.output_len // 2
                predicted = serving.step_time(setup, accelerator, decode_contexts=[context] * batch).total_s
                at_bandwidth = serving.step_time(setup, _at_bandwidth(accelerator, bandwidth),
                                                 decode_contexts=[context] * batch).total_s
                measured = median([median(r) for r in repeats])
                steps = sorted(s for r in repeats for s in r)
                fastest, quartile = steps[0], steps[len(steps) // 4]
                label = f"{name} {dtype} batch {batch:3d}{' (decode graph)' if graph else ''}"
                print(f"{label}: measured {1e3 * measured:7.3f} ms/step (repeats "
                      f"{', '.join(f'{1e3 * median(r):.3f}' for r in repeats)}; fastest {1e3 * fastest:.3f}, "
                      f"first quartile {1e3 * quartile:.3f}), predicted {1e3 * predicted:7.3f}, ratio "
                      f"{measured / predicted:.2f}; at the {bandwidth / 1e9:.1f} GB/s read around it "
                      f"{1e3 * at_bandwidth:7.3f}, ratio {measured / at_bandwidth:.2f}", flush=True)
                rows.append({"shape": name, "dtype": dtype, "batch": batch, "decode_graph": graph,
                             "measured_ms": 1e3 * measured,
                             "repeat_ms": [1e3 * median(r) for r in repeats], "fastest_ms": 1e3 * fastest,
                             "first_quartile_ms": 1e3 * quartile, "predicted_ms": 1e3 * predicted,
                             "read_gb_per_s": bandwidth / 1e9, "predicted_at_read_ms": 1e3 * at_bandwidth})
                if args.ops:
                    for op, count in sorted(step_ops(llm, prompts).items()):
                        print(f"    {count:5d} {op}")
            del llm
    print_json({"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
