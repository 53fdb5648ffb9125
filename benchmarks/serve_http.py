"""HTTP serving against the offline engine on the same workload, and optionally vLLM's server.

Workload: `slipstream bench serve`'s random dataset (token-id prompts of exactly --input-len tokens,
--output-len output tokens with ignore_eos, greedy). The baseline is `LLM.generate` on the same
prompts in this process (output tokens / wall time, prefill included); `slipstream serve` runs
in a subprocess with the same engine arguments. Saturated HTTP runs (request rate inf) alternate
with offline runs, --repeats times, so that load from elsewhere on the machine hits both alike;
the ratio is of the medians. One Poisson run at --rate-fraction of the saturated request rate
gives TTFT and TPOT percentiles. With --vllm-python, vLLM's OpenAI server (CPU backend) gets the
same saturated and Poisson runs from the same client.

    python benchmarks/serve_http.py --preset tiny --num-prompts 64
    python benchmarks/serve_http.py --vllm-python /work/vllm-venv/bin/python

Prints each run's table, the ratio HTTP / offline, and a final JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ensure_model, machine, print_json
from vllm_driver import vllm_env

from slipstream import LLM, SamplingParams
from slipstream.model.tokenizer import Tokenizer
from slipstream.serve.bench import BenchConfig, format_result, random_requests, run_benchmark

MODEL_NAME = "bench-model"


class Offline:
    """The baseline: LLM.generate on a workload's prompts in this process, warmed up once."""

    def __init__(self, model_dir: Path, dtype: str, engine_args: dict) -> None:
        self.llm = LLM(str(model_dir), dtype=dtype, **engine_args)
        self.llm.generate([[5, 6, 7]] * 2, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    def output_throughput(self, prompts: list[list[int]], output_len: int) -> float:
        self.llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def start_server(command: list[str], url: str, log_path: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[0]} did not start; see {log_path}")


def workload(url: str, model_dir: Path, args: argparse.Namespace, seed: int, **changes) -> BenchConfig:
    return BenchConfig(base_url=url, model=MODEL_NAME, tokenizer=str(model_dir), num_prompts=args.num_prompts,
                       random_input_len=args.input_len, random_output_len=args.output_len, ignore_eos=True,
                       temperature=0.0, seed=seed, disable_tqdm=True, **changes)


def measure(url: str, model_dir: Path, args: argparse.Namespace, offline: Offline | None) -> dict:
    """Saturated runs against one server, alternating with the offline baseline on the same
    prompts (a new seed per repeat, so no run finds another's prefixes cached), then one Poisson
    run at --rate-fraction of the saturated request rate."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    http, baseline, saturated = [], [], None
    for repeat in range(args.repeats):
        config = workload(url, model_dir, args, args.seed + repeat)
        if offline is not None:
            prompts = [r.prompt for r in random_requests(config, tokenizer, as_text=False)]
            baseline.append(offline.output_throughput(prompts, args.output_len))
        saturated = run_benchmark(config)
        http.append(saturated["output_throughput"])
    poisson = run_benchmark(workload(url, model_dir, args, args.seed + args.repeats,
                                     request_rate=args.rate_fraction * saturated["request_throughput"]))
    for result in (saturated, poisson):
        print(format_result(result))
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    record = {"output_throughput": statistics.median(http), "output_throughput_runs": http,
              "last_saturated": {k: saturated[k] for k in keys}, "poisson_rate": poisson["request_rate"],
              "poisson": {k: poisson[k] for k in keys}}
    if baseline:
        record |= {"offline_output_throughput": statistics.median(baseline), "offline_runs": baseline}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rate-fraction", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    args = parser.parse_args()

    model_dir = ensure_model(args.model_dir, args.preset).resolve()
    url = f"http://127.0.0.1:{args.port}"
    logs = Path(tempfile.mkdtemp(prefix="serve_http_"))
    record = {"model": str(model_dir), "dtype": args.dtype, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "machine": machine()}
    offline = Offline(model_dir, args.dtype, {"max_num_seqs": args.max_num_seqs})
    server = start_server([sys.executable, "-m", "slipstream.cli", "serve", str(model_dir), "--port",
                           str(args.port), "--served-model-name", MODEL_NAME, "--dtype", args.dtype,
                           "--max-num-seqs", str(args.max_num_seqs)], url, logs / "slipstream.log")
    try:
        record["slipstream"] = measure(url, model_dir, args, offline)
    finally:
        server.terminate()
        server.wait(timeout=60)
    del offline
    ratio = record["slipstream"]["output_throughput"] / record["slipstream"]["offline_output_throughput"]
    record["http_over_offline"] = ratio
    print(f"slipstream HTTP / offline output throughput (medians of {args.repeats}): {ratio:.3f}")

    if args.vllm_python:
        vllm = start_server([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(model_dir), "--served-model-name", MODEL_NAME, "--dtype", args.dtype,
                             "--max-num-seqs", str(args.max_num_seqs), "--port", str(args.port)],
                            url, logs / "vllm.log", env=vllm_env(args.vllm_python))
        try:
            record["vllm"] = measure(url, model_dir, args, None)
        finally:
            vllm.terminate()
            vllm.wait(timeout=120)
        record["slipstream_over_vllm"] = (record["slipstream"]["output_throughput"]
                                          / record["vllm"]["output_throughput"])
        print(f"slipstream / vLLM saturated output throughput: {record['slipstream_over_vllm']:.3f}")
    print_json(record)


if __name__ == "__main__":
    main()
