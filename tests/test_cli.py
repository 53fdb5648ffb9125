"""The `slipstream` command as a user runs it: the README's main job and calibration."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from slipstream.perf.hardware import multiplies_bf16


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache (calibration, tokenizers) shared by the tests here, isolated from the user's."""
    return tmp_path_factory.mktemp("cache")


def _run(*args: str, cache_dir) -> subprocess.CompletedProcess:
    env = os.environ | {"XDG_CACHE_HOME": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "slipstream.cli", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_demo_trains_exports_and_generates(tmp_path, cache_dir):
    """`slipstream demo` (the README's main job), shortened to 3 steps on 200 corpus files: the
    loss starts near ln(vocab) (random weights) and falls, the run is exported and the engine
    completes every prompt, it trains in bf16 only where the CPU multiplies bf16, and throughput
    and MFU are positive (MFU's upper end depends on the calibration having run on an idle
    machine, so it is not checked here)."""
    result = _run("demo", "--workdir", str(tmp_path / "demo"), "--max-steps", "3",
                  "--max-documents", "200", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 3 and report["tokens_trained"] == 3 * 8 * 256
    assert report["dtype"] == ("bfloat16" if multiplies_bf16("cpu") else "float32")  # --dtype auto
    assert abs(report["first_train_loss"] - math.log(report["vocab_size"])) < 1.0
    assert report["last_train_loss"] < report["first_train_loss"]
    assert report["first_eval_loss"] is not None and report["last_eval_loss"] < report["first_eval_loss"]
    assert report["tokens_per_s"] > 0 and report["mfu"] > 0
    assert len(report["completions"]) == 4
    assert (tmp_path / "demo" / "model" / "model.safetensors").is_file()
    assert "held-out loss" in result.stdout


def test_perf_calibrate_json_and_table(cache_dir):
    """`slipstream perf calibrate --json` prints a record with a peak per dtype and a bandwidth;
    the second call (table form) reads the cache."""
    result = _run("perf", "calibrate", "--json", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["matmul_flops_per_s"]["fp32"] and record["memory_bandwidth_bytes_per_s"] > 0
    table = _run("perf", "calibrate", cache_dir=cache_dir)
    assert "matmul GFLOP/s" in table.stdout and "memory read" in table.stdout
