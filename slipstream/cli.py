"""The `slipstream` command: thin subcommands over the packages."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.serve.engine import EngineConfig
    from slipstream.serve.server import ServerConfig
    from slipstream.train.config import TrainConfig


def _init_model(args: argparse.Namespace) -> None:
    from slipstream.model.create import create_model_dir

    config = create_model_dir(
        args.preset, args.out_dir, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite
    )
    from slipstream.perf.flops import num_params

    print(f"wrote {args.preset} ({num_params(config) / 1e6:.1f}M parameters, {args.dtype}) to {args.out_dir}")


def _perf_calibrate(args: argparse.Namespace) -> None:
    from slipstream.perf.hardware import calibrate, calibrate_link

    if args.link is not None:
        link = calibrate_link(args.link, force=args.force)
        print(json.dumps(link.to_dict(), indent=2) if args.json else link.describe())
        return
    calibration = calibrate(force=args.force)
    print(json.dumps(calibration.to_dict(), indent=2) if args.json else calibration.format())


def _data_prepare(args: argparse.Namespace) -> None:
    from slipstream.model.create import stdlib_tokenizer
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.train.data import corpus_documents, prepare_dataset

    for source in args.corpus:  # a dataset inside its corpus would be read as documents next time
        if Path(source).is_dir() and Path(args.out).resolve().is_relative_to(Path(source).resolve()):
            raise ValueError(f"--out {args.out} is inside the corpus directory {source}; write the "
                             "dataset elsewhere")
    tokenizer = (Tokenizer.from_pretrained(args.tokenizer) if args.tokenizer
                 else stdlib_tokenizer(args.vocab_size))
    meta = prepare_dataset(args.out, tokenizer, corpus_documents(args.corpus),
                           heldout_fraction=args.heldout_fraction)
    splits = ", ".join(f"{name} {s['num_tokens']:,} tokens ({s['num_documents']} documents)"
                       for name, s in meta["splits"].items())
    print(f"{args.out}: {splits}; vocab {meta['vocab_size']}, {meta['dtype']}")


def _train(args: argparse.Namespace) -> None:
    if args.nproc > 1 or args.max_restarts > 0:
        from slipstream.train.config import load_config

        _launch(args, load_config(args.config, args.overrides))
        return
    from slipstream.train.preemption import PreemptionHandler

    # Before torch is imported (seconds), so that a SIGTERM during start-up stops the worker
    # cleanly (status 0) rather than killing it.
    preemption = PreemptionHandler()
    preemption.install()
    try:
        from slipstream.train.config import load_config
        from slipstream.train.goodput import process_start_time
        from slipstream.train.supervisor import (
            check_job,
            job_world_size,
            lock_run_dir,
            process_locks,
            refuse_a_busy_run_dir,
        )

        config = load_config(args.config, args.overrides)
        refuse_a_busy_run_dir(config.run.dir, process_locks())
        from slipstream.train.trainer import Trainer  # torch: seconds

        check_job(config, job_world_size())
        with contextlib.ExitStack() as locks:
            for name in process_locks():
                locks.enter_context(lock_run_dir(config.run.dir, name))
            Trainer(config, console=print, started_at=process_start_time(), preemption=preemption).run()
    finally:
        preemption.uninstall()


def _launch(args: argparse.Namespace, config: TrainConfig) -> None:
    """One host: torchrun starts a process per rank running this command, and its elastic
    agent restarts them all when one fails (train.supervisor). What can be checked without
    them is checked first: a user error is one line here, not a failure per restart."""
    from slipstream.train.goodput import record_launch
    from slipstream.train.supervisor import (
        JOB_LOCK,
        WORKERS_LOCK,
        check_job,
        launch,
        lock_run_dir,
        refuse_a_busy_run_dir,
        torchrun_command,
    )

    refuse_a_busy_run_dir(config.run.dir, (JOB_LOCK, WORKERS_LOCK))
    check_job(config, args.nproc)
    with lock_run_dir(config.run.dir, JOB_LOCK) as job_lock:
        lock_run_dir(config.run.dir, WORKERS_LOCK).close()  # no worker of an earlier job runs on
        record_launch(config.run.dir)
        train_args = [*(["--config", args.config] if args.config else []), *args.overrides]
        returncode = launch(torchrun_command(args.nproc, args.max_restarts, train_args), keep_open=job_lock)
    if returncode:
        raise SystemExit(returncode)


def _goodput(args: argparse.Namespace) -> None:
    from slipstream.perf.goodput import format_summary, read_ledger, summarize

    events, skipped_lines = read_ledger(args.run_dir)
    if not any(e["event"] == "start" for e in events):
        # Launched, but no process got as far as building its trainer (or one is starting now).
        launches = sum(e["event"] == "launch" for e in events)
        print(json.dumps({"attempts": 0, "launches": launches, "finished": False}) if args.json else
              f"{args.run_dir}: no attempt has started training: {launches} launch(es), none got as "
              "far as building its trainer (the launcher's output says why), or one is starting now")
        return
    summary = summarize(events, skipped_lines=skipped_lines)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


def _export(args: argparse.Namespace) -> None:
    from slipstream.train.export import export_run

    checkpoint = export_run(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype,
                            overwrite=args.overwrite)
    print(f"exported {checkpoint} to {args.out_dir}")


def _perf(args: argparse.Namespace) -> None:
    from slipstream.perf import commands

    text, record = getattr(commands, args.perf_function)(args)
    print(json.dumps(record, indent=2) if args.json else text)


def _demo(args: argparse.Namespace) -> None:
    from slipstream.demo import format_report, run_demo

    report = run_demo(args.workdir, preset=args.preset, max_steps=args.max_steps,
                      max_documents=args.max_documents, dtype=args.dtype)
    print(format_report(report))
    print(json.dumps(report))


def _serve(args: argparse.Namespace) -> None:
    from slipstream.serve.server import run_server

    run_server(*serve_configs(args), log_level="debug" if args.verbose else "info")


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configs of `slipstream serve`'s parsed arguments (and of the
    environment variables vLLM reads)."""
    from slipstream.serve.engine import EngineConfig
    from slipstream.serve.media import MediaConfig
    from slipstream.serve.served_models import (
        http_timeout_keep_alive,
        responses_api_store,
        runtime_lora_updating,
    )
    from slipstream.serve.server import ServerConfig

    engine_config = EngineConfig(
        model=args.model_dir, dtype=args.dtype, quantization=args.quantization, device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_enable_prefix_caching, max_logprobs=args.max_logprobs,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        enforce_eager=args.enforce_eager, num_scheduler_steps=args.num_scheduler_steps,
        speculative_config=args.speculative_config, profiler_config=args.profiler_config, runner=args.runner,
        scheduling_policy=args.scheduling_policy, metrics_dir=args.metrics_dir,
        tensor_parallel_size=args.tensor_parallel_size, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
    )
    if args.gpu_memory_utilization is not None:
        from slipstream.serve.llm import with_memory_utilization

        engine_config = with_memory_utilization(engine_config, args.gpu_memory_utilization)
    responses_store = responses_api_store(os.environ)
    if args.responses_store_size is not None and not responses_store:
        logging.getLogger(__name__).warning(
            "--responses-store-size has no effect: without VLLM_ENABLE_RESPONSES_API_STORE=1 the server "
            "stores no Responses")
    server_config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
        max_waiting=args.max_waiting, drain_timeout_s=args.drain_timeout,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template, lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=runtime_lora_updating(os.environ),
        responses_store=responses_store,
        timeout_keep_alive_s=http_timeout_keep_alive(os.environ),
        media=MediaConfig.from_args(args.allowed_media_domains, args.allowed_local_media_path,
                                    args.media_fetch_timeout),
        **({} if args.responses_store_size is None else {"responses_store_size": args.responses_store_size}),
    )
    return engine_config, server_config


def _bench_serve(args: argparse.Namespace) -> None:
    from slipstream.serve.bench import BenchConfig, format_result, result_filename, run_benchmark

    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles takes comma-separated numbers, got "
                         f"{args.metric_percentiles!r}") from None
    config = BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)}
                         | {"percentile_metrics": tuple(args.percentile_metrics.split(",")),
                            "metric_percentiles": percentiles})
    # vLLM's --save-result is a switch naming no file; the older `--save-result FILE` still works.
    filename = args.save_result if isinstance(args.save_result, str) else args.result_filename
    if isinstance(args.save_result, str) and args.result_filename:
        raise ValueError("give the result file as --save-result --result-filename FILE, not both ways")
    directory = Path(args.result_dir or ".")
    if args.save_result:  # a path that cannot be written is found now, not after the run
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / filename if filename else directory
        writable = os.access(target.parent if filename else target, os.W_OK)
        if (filename and (target.is_dir() or not target.parent.is_dir())) or not writable:
            raise ValueError(f"result file {target}: not a file path in a writable directory")
    result = run_benchmark(config)
    print(format_result(result))
    if args.save_result:
        target = directory / (filename or result_filename(config, result["date"]))
        target.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {target}")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (argparse names the flag in its error)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return count


def _lora_module(text: str):
    """An argparse type: a --lora-modules entry (argparse names the flag in its error)."""
    from slipstream.serve.served_models import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _directory(text: str) -> str:
    """An argparse type: an existing directory (argparse names the flag in its error)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"must be an existing directory, got {text!r}")
    return text


def _add(
    subparsers: argparse._SubParsersAction, name: str, handler: Callable, help: str
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=help)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from slipstream.serve.reasoning_parsers import REASONING_PARSERS  # plain Python, quick to import
    from slipstream.serve.tool_parsers import TOOL_CALL_PARSERS

    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    p = _add(commands, "init-model", _init_model,
             "write a randomly initialised Hugging Face model directory from a preset")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny",
                   help="tiny, tiny-moe, tiny-gemma2, small, medium (see slipstream.model.presets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")

    p = _add(commands, "demo", _demo,
             "the main job on the embedded defaults: train a model on the corpus, export it, "
             "generate with it, report")
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--max-steps", type=_int_at_least(1), default=600, help="training steps (default 600)")
    p.add_argument("--max-documents", type=_int_at_least(2),
                   help="train on an evenly spread subset of this many corpus files (quick checks)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto (default): bfloat16 where the device multiplies bf16, else float32")

    p = _add(commands, "serve", _serve, "serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_dir")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL_DIR)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="most sequences waiting to be scheduled; past it, 503 with Retry-After")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="as vLLM: let requests bring their own chat_template")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='as vLLM: let the model choose whether to call a tool (tool_choice "auto")')
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS),
                   help="the model's tool-call format, for --enable-auto-tool-choice")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="as vLLM: send the model's thinking apart from its answer, in `reasoning`")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="name logprobs tokens 'token_id:ID' unless a request says otherwise (as vLLM)")
    p.add_argument("--responses-store-size", type=_int_at_least(1),
                   help="with VLLM_ENABLE_RESPONSES_API_STORE, the most Responses kept (default 1024; the "
                        "least recently used go first, where vLLM keeps every one)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                   help="as vLLM: the only hosts http(s) image URLs (and their redirects) may name; set it "
                        "on any server untrusted clients reach (default: any host)")
    p.add_argument("--allowed-local-media-path", type=_directory, metavar="DIR",
                   help="as vLLM: the directory file:// image URLs may name files under (default, or \"\": "
                        "file URLs are refused)")
    p.add_argument("--media-fetch-timeout", type=_positive_float, default=5.0, metavar="S",
                   help="seconds a whole image fetch may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT; default 5)")
    p.add_argument("--limit-mm-per-prompt", metavar="JSON",
                   help='as vLLM: the most images a prompt may hold, e.g. \'{"image": 2}\' (default 999; '
                        "0 serves a multimodal checkpoint as a text model, its image encoder not loaded)")
    p.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16, float16 (also vLLM's float and half)")
    p.add_argument("-q", "--quantization",
                   help="vLLM's flag, with slipstream's value int8: quantize the decoder layers' linear "
                        "weights after loading (weight-only, one scale per output channel); default: the "
                        "weights in --dtype")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="as in vLLM: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2 or bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="as in vLLM: the fraction of the device's memory (RAM on a CPU) for the "
                        "weights and the KV cache, which gets what the weights leave")
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="as in vLLM: layers with a sliding window keep every block too (by default they "
                        "give back the blocks their window has passed)")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step module by module (no CPU decode graph)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (this one and workers it starts; "
                        "on a CPU each gets its share of the threads, on CUDA one GPU each)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="greedy decode steps run at once when every running request allows it "
                        "(tokens then stream in bursts)")
    p.add_argument("--speculative-config",
                   help='as vLLM: JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(n-gram speculative decoding of greedy requests)")
    p.add_argument("--profiler-config",
                   help='as vLLM: JSON, e.g. \'{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}\' '
                        "(adds POST /start_profile and /stop_profile; docs/engine.md, Profiling)")
    p.add_argument("--metrics-dir",
                   help="append JSON-lines metrics records (engine steps, finished requests) to "
                        "METRICS_DIR/metrics.jsonl, which `slipstream perf report`, "
                        "`perf fit --engine-records` and `perf roofline --records` read")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="as vLLM: pooling serves /v1/embeddings instead of generating")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="as vLLM: priority serves requests by their `priority` field (lower first), "
                        "preempting lower ones for blocks")
    p.add_argument("--enable-lora", action="store_true",
                   help="as vLLM: serve LoRA adapters (requests name one as their `model`)")
    p.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module, default=[],
                   metavar="MODULE",
                   help='as vLLM: adapters to serve, each NAME=PATH or JSON \'{"name": ..., "path": ..., '
                        '"base_model_name": ...}\' (needs --enable-lora)')
    p.add_argument("--max-loras", type=_int_at_least(1), default=1,
                   help="as vLLM: most distinct adapters in one batch")
    p.add_argument("--max-lora-rank", type=_int_at_least(1), default=16,
                   help="as vLLM: the largest adapter rank accepted")
    p.add_argument("--max-cpu-loras", type=_int_at_least(1),
                   help="as vLLM: adapters kept loaded while no request uses them (default: --max-loras)")

    bench = _add(commands, "bench", None, "benchmarks")
    bench = bench.add_subparsers(dest="bench_command", required=True)
    p = _add(bench, "serve", _bench_serve,
             "load-test an OpenAI-compatible server with vLLM's `bench serve` metrics")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--tokenizer", help="model directory with tokenizer.json (default: --model)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, help="override each ShareGPT reply's length")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, help="sent with each request; default: none sent, as vLLM")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated latencies to report statistics of: ttft, tpot, itl, e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--save-result", nargs="?", const=True, default=False, metavar="FILE",
                   help="write the result JSON, named by --result-dir and --result-filename (default: "
                   "vLLM's BACKEND-RATEqps-MODEL-DATE.json); `--save-result FILE` is the older form")
    p.add_argument("--result-dir", help="directory of the result file (made if missing; default: .)")
    p.add_argument("--result-filename", help="name of the result file")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--ready-timeout", dest="ready_timeout_s", type=_positive_float, default=60.0,
                   help="seconds the initial test request may wait to connect and for each piece "
                   "of its response (default 60)")

    data = _add(commands, "data", None, "training data")
    data = data.add_subparsers(dest="data_command", required=True)
    p = _add(data, "prepare", _data_prepare,
             "tokenize a corpus into memory-mapped token shards with a held-out split")
    p.add_argument("--corpus", nargs="+", default=["stdlib"],
                   help="'stdlib' (the standard library's sources), directories or files")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: a BPE trained "
                   "on the standard library, of --vocab-size tokens)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--heldout-fraction", type=float, default=0.01)
    p.add_argument("--out", required=True)

    p = _add(commands, "train", _train,
             "train a model: --config FILE.toml and --section.key=value overrides "
             "(see docs/training.md)")
    p.add_argument("--config", help="a TOML file of [section] tables")
    p.add_argument("--nproc", type=_int_at_least(1), default=1,
                   help="processes on this host (started with torchrun)")
    p.add_argument("--max-restarts", type=_int_at_least(0), default=0,
                   help="restart the job from its newest checkpoint after a failure or hang, at "
                   "most this many times (torchrun's elastic agent; see docs/training.md)")
    p.set_defaults(accepts_overrides=True)

    p = _add(commands, "goodput", _goodput,
             "where a training run's wall time went, across restarts: productive steps and "
             "each named loss")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")

    p = _add(commands, "export", _export,
             "write a training run's checkpoint as a Hugging Face model directory")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")

    perf = _add(commands, "perf", None, "performance tools")
    perf = perf.add_subparsers(dest="perf_command", required=True)
    p = _add(perf, "calibrate", _perf_calibrate,
             "measure this machine's matmul peak per dtype and GEMM path, and its memory bandwidth")
    p.add_argument("--json", action="store_true")
    p.add_argument("--force", action="store_true", help="measure again instead of using the cache")
    p.add_argument("--link", type=_int_at_least(2), metavar="RANKS",
                   help="instead, the gloo link among RANKS processes of this host (what perf prices "
                        "multi-rank CPU training runs with; measured the first time one is priced)")
    for name, function, groups, help in _PERF_COMMANDS:
        p = _add(perf, name, _perf, help)
        _perf_arguments(p, groups)
        # A command refuses an option its path would drop, when it is set to other than this.
        p.set_defaults(perf_function=function, default_of=p.get_default)
    return parser


_PERF_COMMANDS = [
    ("train", "train", ("model", "train", "layout"), "predict training step time, memory per device and MFU"),
    ("serve", "serve", ("model", "tp", "decode", "input", "output", "load", "kvcache"),
     "predict prefill, per-token decode, KV capacity and load behaviour"),
    ("plan", "plan", ("model", "train", "input", "output", "plan"),
     "rank the parallel layouts that fit on N devices"),
    ("whatif", "what_if", ("model", "train", "layout", "decode", "whatif"),
     "scale FLOP/s, bandwidth, capacity or links: what bounds the workload, what reaches a target"),
    ("roofline", "roofline_cmd", ("model", "tp", "decode", "input", "roofline"),
     "roofline table and PNG with operating points"),
    ("collectives", "collectives", ("collectives",),
     "measure torch.distributed collectives (gloo here, NCCL on GPUs) and fit alpha-beta"),
    ("validate", "validate", (), "the model against published measurements (data/published.json)"),
    ("fit", "fit", ("model", "tp", "fit"), "fit the efficiency to this machine's metrics records"),
    ("trace", "trace_cmd", ("trace",),
     "where a profiled run's time went, from its PyTorch profiler traces (one per rank)"),
    ("report", "report_cmd", ("report",),
     "an HTML report of a training or serving run, measured against the performance model"),
]


def _perf_arguments(p: argparse.ArgumentParser, groups: tuple[str, ...]) -> None:
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    if "model" in groups:
        p.add_argument("--model", default="llama3-8b", help="preset, GPT shape (gpt3-175b, megatron-22b/"
                       "175b/530b/1t) or a config.json path")
        p.add_argument("--hardware", default="h100", help="a100, h100, h200, b200, mi300x, v5e, v5p, cpu")
        p.add_argument("--dtype", default="bf16")
        efficiency = p.add_mutually_exclusive_group()
        efficiency.add_argument("--profile", help="efficiency fitted to published runs (see perf validate)")
        efficiency.add_argument("--efficiency", help="efficiency JSON written by `slipstream perf fit`")
    if "train" in groups:
        p.add_argument("--devices", type=_int_at_least(1), default=8)
        p.add_argument("--global-batch", type=_int_at_least(1), default=256, help="sequences per step")
        p.add_argument("--seq-len", type=_int_at_least(1), default=8192)
        p.add_argument("--micro-batch", type=_int_at_least(1), default=1)
        p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
        p.add_argument("--attention", default="flash", choices=["flash", "unfused"])
        p.add_argument("--pointwise", default="eager", choices=["eager", "fused"],
                       help="norms, activation and rotary embedding op by op (eager PyTorch, "
                            "slipstream's trainer) or one kernel each (Megatron, torch.compile)")
        p.add_argument("--mixed-precision", default="autocast", choices=["autocast", "parameters"],
                       help="16-bit training on fp32 weights under torch.autocast (slipstream's "
                            "trainer: fp32 residual stream, weights cast per micro-batch) or on "
                            "16-bit parameters (Megatron, FSDP param_dtype)")
    if "layout" in groups:
        for name in ("tp", "pp", "cp", "vp"):
            p.add_argument(f"--{name}", type=_int_at_least(1), default=1)
        p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="3 = FSDP")
        p.add_argument("--no-sp", action="store_true", help="no sequence parallelism with tp > 1")
        p.add_argument("--gpipe", action="store_true",
                       help="GPipe's pipeline schedule instead of 1F1B (needs --pp > 1, --vp 1): every "
                            "forward, then every backward; the same bubble, every micro-batch held")
    # Serving options, each only on the commands that read it (an option a command ignores would
    # be a silently dropped request).
    if "tp" in groups:
        p.add_argument("--tp", type=_int_at_least(1), default=1)
    if "decode" in groups:
        p.add_argument("--batch", default="1,8,32", help="decode batch sizes")
        p.add_argument("--context", type=_int_at_least(1), default=1024, help="cached tokens per sequence")
    if "decode" in groups or "plan" in groups or "fit" in groups:
        p.add_argument("--enforce-eager", action="store_true",
                       help="decode steps run eagerly (default: as the engine, replayed from CUDA graphs "
                            "up to --max-num-seqs, or on --hardware cpu the CPU decode graph); plan and "
                            "whatif take it with --serve, fit with --engine-records, refusing it otherwise")
    if "input" in groups:
        p.add_argument("--input-len", type=_int_at_least(1), default=1024)
    if "output" in groups:
        p.add_argument("--output-len", type=_int_at_least(1), default=256)
    if "kvcache" in groups:
        p.add_argument("--kv-cache-memory", type=_positive_float, metavar="BYTES",
                       help="the KV cache's bytes per device (vLLM's kv_cache_memory_bytes); default: "
                            "90%% of memory less the weights and 1 GiB, or on --hardware cpu the "
                            "serving engine's CPU default (at most 4 GiB and 40%% of memory)")
        p.add_argument("--block-size", type=_int_at_least(1), default=16, help="tokens per KV block")
        p.add_argument("--kv-cache-dtype", default="auto",
                       help="the KV cache's dtype (vLLM's flag): auto (the model's 16-bit dtype, also under "
                            "--dtype fp8), fp8, fp8_e4m3, fp8_e5m2, bfloat16")
    if "load" in groups:
        p.add_argument("--rate", type=_positive_float, help="requests/s for TTFT/TPOT under load")
    if "load" in groups or "plan" in groups:
        p.add_argument("--max-num-seqs", type=_int_at_least(1), default=256)
    if "plan" in groups:
        p.add_argument("--serve", action="store_true", help="plan serving (TP x replicas) instead")
        p.add_argument("--top", type=_int_at_least(1), default=10)
    if "whatif" in groups:
        p.add_argument("--serve", action="store_true", help="a decode step instead of a training step")
        p.add_argument("--scale", help="e.g. flops=2,memory_bandwidth=1.5,memory_capacity=2,link=2")
        p.add_argument("--target-step-s", type=_positive_float)
        p.add_argument("--target-tokens-per-s-per-user", type=_positive_float)
    if "roofline" in groups:
        p.add_argument("--records", help="engine step records (JSON lines) to place measured points, or "
                       "the serving engine's --metrics-dir (its model, dtype and hardware then default "
                       "to the engine's)")
        p.add_argument("--out", help="write the roofline PNG here (needs matplotlib)")
        # Unset, the engine's header names them, else the other commands' defaults (commands.py).
        p.set_defaults(model=None, dtype=None, hardware=None)
    if "collectives" in groups:
        p.add_argument("--world-size", type=int, default=2)
        p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
        p.add_argument("--sizes", default=",".join(str(2**k) for k in range(10, 25, 2)), help="bytes")
        p.add_argument("--iterations", type=_int_at_least(1), default=10)
    if "fit" in groups:
        records = p.add_mutually_exclusive_group(required=True)
        records.add_argument("--engine-records",
                             help="engine step records: a JSON-lines file, or the serving engine's "
                                  "--metrics-dir (its model, dtype and hardware then default to the "
                                  "engine's)")
        records.add_argument("--run-dir", nargs="+", help="training run directories")
        p.add_argument("--out", help="write the fitted efficiency JSON here")
        # Unset, the engine's header names them, else the other commands' defaults (commands.py).
        p.set_defaults(model=None, dtype=None, hardware=None)
    if "report" in groups:
        p.add_argument("run", metavar="RUN", help="a training run directory, a serving --metrics-dir, or "
                       "its metrics.jsonl")
        p.add_argument("--out", help="the HTML file to write (default RUN/report.html)")
        p.add_argument("--hardware", help="a100, h100, ..., cpu (default: the run's, cpu for a CPU run)")
        p.add_argument("--model", help="a preset or config.json in place of the run's model directory "
                       "(where that is gone)")
        p.add_argument("--enforce-eager", action="store_true",
                       help="a serving run's engine ran with --enforce-eager: price its decode steps eagerly "
                            "(for records whose header has no enforce_eager field)")
        efficiency = p.add_mutually_exclusive_group()
        efficiency.add_argument("--profile", help="efficiency fitted to published runs (see perf validate)")
        efficiency.add_argument("--efficiency", help="efficiency JSON written by `slipstream perf fit`")
    if "trace" in groups:
        p.add_argument("traces", nargs="+", metavar="TRACE",
                       help="Kineto trace files (.json, .json.gz) or folders of them, one file per rank")
        p.add_argument("--top", type=_int_at_least(1), default=10,
                       help="rows in each table (default 10); past 2 x TOP steps, their spread and the "
                            "TOP slowest")
        p.add_argument("--baseline", nargs="+", default=(), metavar="TRACE",
                       help="traces of an earlier run: what changed per step, op by op and kernel by kernel")
        p.add_argument("--hardware", help="the roofline the ops are priced on: a100, h100, ..., cpu "
                       "(default: a GPU trace's own GPU from the table, this CPU calibrated for a CPU trace)")
        p.add_argument("--critical-path", action="store_true",
                       help="each rank's critical path (HTA's) of one step, the slowest (the step whose "
                            "slowest rank took longest) unless --critical-step: which host ops, launches, "
                            "kernels and waits set the step's time")
        p.add_argument("--critical-step", type=_int_at_least(0), metavar="N",
                       help="the critical path of ProfilerStep#N (implies --critical-path)")


def main(argv: Sequence[str] | None = None) -> int:
    # At exit, the interpreter's final collections walk every object torch made: 0.6-0.8 s of
    # each command's (and torchrun worker's) exit, 0.2 s with them skipped, as they are once
    # frozen in an exit handler (benchmarks/process_exit.py). The other handlers and threads are
    # finished as before and objects outside reference cycles still freed; only cycles left at
    # exit go uncollected (the files slipstream writes are flushed record by record, or closed).
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.handler(args)
        sys.stdout.flush()  # a closed pipe raises here, inside the try, not at exit
    except BrokenPipeError:
        # The reader went away (`slipstream perf ... | head`): as CPython's note on SIGPIPE says,
        # point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:  # OSError: a path that is a file, read-only, missing, ...
        print(f"slipstream {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
