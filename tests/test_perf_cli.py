"""`slipstream perf train|serve|plan|whatif|roofline|validate|fit` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slipstream.cli", "perf", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=os.environ.copy())


def test_train_json_has_the_required_keys():
    """Guards `perf train --json`: step_time_s, mfu and memory_bytes_per_device are reported."""
    result = _run("train", "--model", "megatron-175b", "--hardware", "a100", "--devices", "64",
                  "--tp", "8", "--pp", "8", "--vp", "3", "--global-batch", "64", "--seq-len", "2048",
                  "--dtype", "fp16", "--recompute", "selective", "--attention", "unfused", "--zero", "0",
                  "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["step_time_s"] > 0 and 0 < record["mfu"] < 1 and record["memory_bytes_per_device"] > 0
    table = _run("train", "--model", "llama3-8b", "--hardware", "h100", "--devices", "8", "--zero", "3")
    assert "MFU" in table.stdout and "GiB per device" in table.stdout


def test_serve_json_has_prefill_and_decode():
    """Guards `perf serve --json`: prefill time and per-token decode time (batch 1, 8, 32)."""
    result = _run("serve", "--model", "llama3-70b", "--hardware", "h200", "--tp", "4", "--json",
                  "--rate", "2")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["prefill_s"] > 0 and record["decode_s_per_token"] > 0
    assert [r["batch_size"] for r in record["decode"]] == [1, 8, 32]
    assert record["kv_capacity"]["max_sequences"] > 0 and "ttft_s" in record["load"]


def test_plan_and_whatif_tables():
    """Guards `perf plan` (a ranked table with an explanation) and `perf whatif` (requirements)."""
    plan = _run("plan", "--model", "llama3-8b", "--hardware", "h100", "--devices", "16",
                "--global-batch", "64", "--seq-len", "4096", "--top", "3")
    assert plan.returncode == 0, plan.stderr
    assert "#1 " in plan.stdout and "bound by" in plan.stdout
    whatif = _run("whatif", "--model", "llama3-70b", "--hardware", "h100", "--serve", "--tp", "8",
                  "--batch", "1", "--scale", "memory_bandwidth=2", "--target-tokens-per-s-per-user", "100",
                  "--json")
    assert whatif.returncode == 0, whatif.stderr
    record = json.loads(whatif.stdout)
    reqs = {r["resource"]: r for r in record["requirements"]}
    assert reqs["memory_bandwidth"]["factor"] and reqs["flops"]["factor"] is None


def test_roofline_png_or_clear_message(tmp_path):
    """Guards `perf roofline --out`: a PNG with matplotlib, else the table and a clear message."""
    out = tmp_path / "roofline.png"
    result = _run("roofline", "--model", "llama3-8b", "--hardware", "h100", "--out", str(out))
    assert result.returncode == 0, result.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "needs matplotlib" in result.stdout
    else:
        assert out.read_bytes()[:4] == b"\x89PNG"
    assert "FLOP/B" in result.stdout and "decode bs1" in result.stdout


def test_unknown_hardware_is_a_clear_error():
    """Guards user errors: an unknown device exits 2 with the known names."""
    result = _run("train", "--hardware", "a800")
    assert result.returncode == 2 and "known:" in result.stderr


@pytest.mark.parametrize("profile", ["megatron-2022-a100", "llama3-h100"])
def test_profiles_apply_to_any_hardware(profile):
    """Guards --profile: multipliers fitted to published runs apply to the chosen device."""
    result = _run("train", "--model", "llama3-8b", "--hardware", "b200", "--devices", "8", "--zero", "3",
                  "--global-batch", "16", "--profile", profile, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["efficiency"].startswith(f"profile {profile}")
