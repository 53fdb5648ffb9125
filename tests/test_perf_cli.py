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


def _error(argv: list[str], capsys) -> str:
    """The one-line error `slipstream` prints for `argv`, after checking it exits 2."""
    from slipstream.cli import main

    with pytest.raises(SystemExit) as exit_info:  # argparse errors exit from inside main
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["train", "--tp", "0"], "argument --tp: must be an integer >= 1, got '0'"),
    (["train", "--pp", "0"], "argument --pp: must be an integer >= 1, got '0'"),
    (["train", "--cp", "0"], "argument --cp: must be an integer >= 1, got '0'"),
    (["train", "--tp", "-2"], "argument --tp: must be an integer >= 1, got '-2'"),
    (["train", "--devices", "0"], "argument --devices: must be an integer >= 1, got '0'"),
    (["serve", "--batch", "0"], "--batch expects comma-separated integers >= 1, got '0'"),
    (["serve", "--batch", "-4"], "--batch expects comma-separated integers >= 1, got '-4'"),
    (["serve", "--batch", ","], "--batch expects comma-separated integers >= 1, got ','"),
    (["serve", "--batch="], "--batch expects comma-separated integers >= 1, got ''"),
    (["serve", "--batch", "1,x"], "--batch expects comma-separated integers, got '1,x'"),
    (["whatif", "--serve", "--batch", "0"], "--batch expects comma-separated integers >= 1, got '0'"),
    (["roofline", "--batch", ","], "--batch expects comma-separated integers >= 1, got ','"),
    (["plan", "--top", "0"], "argument --top: must be an integer >= 1, got '0'"),
    (["plan", "--top", "-1"], "argument --top: must be an integer >= 1, got '-1'"),
    (["plan", "--devices", "0"], "argument --devices: must be an integer >= 1, got '0'"),
    (["plan", "--serve", "--devices", "1", "--model", "llama3-70b"],
     "no tensor-parallel degree of llama3-70b fits on 1 x"),
    (["serve", "--rate", "0"], "argument --rate: must be a number > 0, got '0'"),
    (["serve", "--rate", "nan"], "argument --rate: must be a number > 0, got 'nan'"),
    (["whatif", "--target-step-s", "0"], "argument --target-step-s: must be a number > 0, got '0'"),
    (["whatif", "--serve", "--target-step-s", "1"], "--target-step-s is for a training step"),
    (["whatif", "--target-tokens-per-s-per-user", "10"], "is for a decode step: add --serve"),
    (["whatif", "--scale", "flops"], "--scale expects NAME=FACTOR pairs, got 'flops'"),
    (["collectives", "--sizes", ","], "--sizes expects comma-separated integers >= 1, got ','"),
])
def test_out_of_range_flags_are_errors_naming_the_flag(argv, expected, capsys):
    """Guards the perf flags: a zero, negative or empty count or rate is an error naming the
    flag and the value (not a ZeroDivisionError, an IndexError or a silently ignored flag)."""
    assert expected in _error(["perf", *argv], capsys)


@pytest.mark.parametrize("config, expected", [
    ("[1, 2]", "must hold a JSON object of model settings, got list"),
    ("{bad", "is not valid JSON"),
    ('{"model_type": "llama"}', "lacks vocab_size, hidden_size, intermediate_size"),
    ('{"n_embd": 768, "n_layer": 2, "vocab_size": 100}', "lacks n_head"),
    ('{"n_embd": 768, "n_layer": 2, "n_head": 7, "vocab_size": 100}',
     "n_embd (768) must be a multiple of n_head (7)"),
    ('{"n_embd": 768, "n_layer": "2", "n_head": 12, "vocab_size": 100}',
     "n_layer must be a positive integer, got '2'"),
    ('{"model_type": "llama", "vocab_size": 8, "hidden_size": "x", "intermediate_size": 8, '
     '"num_hidden_layers": 1, "num_attention_heads": 1}', "hidden_size must be a positive integer"),
])
def test_malformed_config_json_is_an_error_naming_the_file(config, expected, tmp_path, capsys):
    """Guards `--model CONFIG.json`: a JSON list, missing keys, a GPT-2 width that n_head does
    not divide, or a bad value is an error naming the file and the key."""
    path = tmp_path / "config.json"
    path.write_text(config)
    err = _error(["perf", "train", "--model", str(path)], capsys)
    assert str(path) in err and expected in err, err


@pytest.mark.parametrize("content, expected", [
    (None, "is a directory; expected a file"),
    ('{"gemm_fraction": "abc"}', "gemm_fraction must be a number, got 'abc'"),
    ('{"gemm_fraction": null}', "gemm_fraction must be a number, got None"),
    ('{"link_latency_s": NaN}', "link_latency_s must be a number, got nan"),
    ("[0.8]", "must be a JSON object"),
    ("{bad", "is not valid JSON"),
])
def test_bad_efficiency_file_is_an_error_naming_it(content, expected, tmp_path, capsys):
    """Guards `--efficiency FILE`: a directory, a non-number or a non-object is an error naming
    the flag, the file and the bad value."""
    path = tmp_path / "efficiency.json"
    path.mkdir() if content is None else path.write_text(content)
    err = _error(["perf", "train", "--efficiency", str(path)], capsys)
    assert f"--efficiency {path}" in err and expected in err, err


@pytest.mark.parametrize("record, flag", [
    ({"phase": "decode", "batch_size": 1, "context_len": -5, "step_s": 0.01}, "--records"),
    ({"phase": "decode", "batch_size": 1, "context_len": 5, "step_s": -0.01}, "--records"),
    ({"phase": "prefill", "batch_size": 0, "prompt_len": 5, "step_s": 0.01}, "--engine-records"),
])
def test_impossible_engine_records_are_errors(record, flag, tmp_path, capsys):
    """Guards `roofline --records` and `fit --engine-records`: a negative time or length or an
    empty batch is an error naming the file, a directory too."""
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"kind": "engine_step", **record}) + "\n")
    command = "roofline" if flag == "--records" else "fit"
    err = _error(["perf", command, flag, str(path)], capsys)
    assert f"{flag} {path}: an engine step needs step_s > 0" in err, err
    assert "is a directory" in _error(["perf", command, flag, str(tmp_path)], capsys)


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """Guards `slipstream perf ... | head`: the reader closing the pipe ends the command
    quietly (status 1, CPython's advice for SIGPIPE), not with a BrokenPipeError traceback."""
    process = subprocess.Popen([sys.executable, "-m", "slipstream.cli", "perf", "plan", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1 and "BrokenPipeError" not in err and "Traceback" not in err, err


def test_train_pointwise_and_precision_flags_reach_the_model(capsys):
    """`perf train --pointwise fused --mixed-precision parameters` predicts what TrainSetup with
    those fields does; eager and autocast (the defaults, what slipstream's trainer runs) are each
    slower."""
    from slipstream.cli import main
    from slipstream.perf.accelerators import get_accelerator
    from slipstream.perf.model import Layout, TrainSetup, predict_training
    from slipstream.perf.shapes import resolve_model

    times = {}
    for pointwise in ("eager", "fused"):
        for precision in ("autocast", "parameters"):
            assert main(["perf", "train", "--model", "llama3-8b", "--hardware", "h100", "--devices", "8",
                         "--global-batch", "16", "--micro-batch", "2", "--zero", "3",
                         "--pointwise", pointwise, "--mixed-precision", precision, "--json"]) == 0
            times[pointwise, precision] = json.loads(capsys.readouterr().out)["step_time_s"]
            setup = TrainSetup(shape=resolve_model("llama3-8b"), global_batch_size=16, seq_len=8192,
                               micro_batch_size=2, pointwise=pointwise, mixed_precision=precision)
            expected = predict_training(setup, Layout(dp=8, zero_stage=3), get_accelerator("h100"))
            assert times[pointwise, precision] == pytest.approx(expected.step_time_s)
    for precision in ("autocast", "parameters"):
        assert times["eager", precision] > times["fused", precision]
    for pointwise in ("eager", "fused"):
        assert times[pointwise, "autocast"] > times[pointwise, "parameters"]
