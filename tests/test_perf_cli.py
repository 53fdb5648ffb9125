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
                  "--batch", "1", "--scale", "memory_bandwidth=2", "--target-tokens-per-s-per-user", "150",
                  "--json")
    assert whatif.returncode == 0, whatif.stderr
    record = json.loads(whatif.stdout)
    reqs = {r["resource"]: r for r in record["decode"][0]["requirements"]}
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
    (["serve", "--batch", "0"], "--batch expects comma-separated integers >= 1 and <= 1,048,576, got '0'"),
    (["serve", "--batch", "-4"], "--batch expects comma-separated integers >= 1 and <= 1,048,576, got '-4'"),
    (["serve", "--batch", ","], "--batch expects comma-separated integers >= 1 and <= 1,048,576, got ','"),
    (["serve", "--batch="], "--batch expects comma-separated integers >= 1 and <= 1,048,576, got ''"),
    (["serve", "--batch", "1,x"], "--batch expects comma-separated integers, got '1,x'"),
    (["serve", "--batch", "99999999999999999"], "<= 1,048,576, got '99999999999999999'"),  # was a MemoryError
    (["plan", "--devices", "99999999999", "--global-batch", "8"], "no layout of llama3-8b fits"),  # hung
    (["whatif", "--serve", "--batch", "0"], "--batch expects comma-separated integers >= 1 and <= 1,048,576"),
    (["roofline", "--batch", ","], "--batch expects comma-separated integers >= 1 and <= 1,048,576, got ','"),
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
    ('{"model_type": "gemma3", "text_config": {"model_type": "gemma2"}}',
     "a 'gemma3' config.json's text_config has model_type 'gemma2'; expected 'gemma3_text'"),
    ('{"model_type": "mistral3"}', "unsupported model_type 'mistral3'"),
    ('{"n_embd": 768, "n_layer": 2, "n_head": 7, "vocab_size": 100}',
     "n_embd (768) must be a multiple of n_head (7)"),
    ('{"n_embd": 768, "n_layer": "2", "n_head": 12, "vocab_size": 100}',
     "n_layer must be a positive integer, got '2'"),
    ('{"model_type": "llama", "vocab_size": 8, "hidden_size": "x", "intermediate_size": 8, '
     '"num_hidden_layers": 1, "num_attention_heads": 1}', "hidden_size must be a positive integer"),
])
def test_malformed_config_json_is_an_error_naming_the_file(config, expected, tmp_path, capsys):
    """Guards `--model CONFIG.json`: a JSON list, missing keys, a model_type ModelConfig does not
    read (its own message, not "lacks vocab_size"), a multimodal Gemma 3 config whose text_config is
    another family's, a GPT-2 width that n_head does not divide, or a bad value is an error
    naming the file and the key."""
    path = tmp_path / "config.json"
    path.write_text(config)
    err = _error(["perf", "train", "--model", str(path)], capsys)
    assert str(path) in err and expected in err, err


@pytest.mark.parametrize("content, expected", [
    (None, "is a directory; expected a file"),
    ('{"gemm_fraction": "abc"}', "gemm_fraction must be a finite number, got 'abc'"),
    ('{"gemm_fraction": null}', "gemm_fraction must be a finite number, got None"),
    ('{"link_latency_s": NaN}', "link_latency_s must be a finite number, got nan"),
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
    ({"phase": "decode", "batch_size": 1, "context_len": 5, "step_s": float("inf")}, "--records"),
    ({"phase": "decode", "batch_size": 1.5, "context_len": 5, "step_s": 0.01}, "--records"),
    ({"phase": "prefill", "batch_size": 1, "prompt_len": 0, "step_s": 0.01}, "--records"),
    ({"phase": "bogus", "batch_size": 1, "prompt_len": 5, "step_s": 0.01}, "--records"),
    ({"phase": "prefill", "batch_size": 0, "prompt_len": 5, "step_s": 0.01}, "--engine-records"),
])
def test_impossible_engine_records_are_errors(record, flag, tmp_path, capsys):
    """Guards `roofline --records` and `fit --engine-records`: a file whose every record is
    malformed (a negative, infinite or zero time, length or batch, a fractional batch, an unknown
    phase) is an error naming the file, not a table without its points; a directory too."""
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"kind": "engine_step", **record}) + "\n[1, 2]\nnull\n")
    command = "roofline" if flag == "--records" else "fit"
    err = _error(["perf", command, flag, str(path)], capsys)
    assert f"{flag} {path}: no well-formed engine_step records" in err, err
    assert "is a directory" in _error(["perf", command, flag, str(tmp_path)], capsys)


def test_efficiency_beyond_a_datasheet_peak_is_an_error(tmp_path, capsys):
    """A fraction above 1 of a datasheet's peak would predict an MFU above 100% (no run beats the
    datasheet): an error naming the field; fitted files are capped at 1 there too."""
    path = tmp_path / "efficiency.json"
    path.write_text(json.dumps({"gemm_fraction": 1.5}))
    err = _error(["perf", "train", "--hardware", "h100", "--efficiency", str(path)], capsys)
    assert f"--efficiency {path}: gemm_fraction 1.5 is more than H100" in err, err
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"kind": "engine_step", "phase": "decode", "batch_size": b,
                                           "context_len": 512, "step_s": 1e-6}) + "\n" for b in (1, 8)))
    out = tmp_path / "fitted.json"
    _run("fit", "--hardware", "h100", "--model", "tiny", "--engine-records", str(records),
         "--out", str(out))
    fitted = json.loads(out.read_text())
    assert max(fitted[k] for k in ("gemm_fraction", "memory_fraction")) <= 1.0


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--profile", "x", "--efficiency", "y"],
     "argument --efficiency: not allowed with argument --profile"),
    (["fit", "--engine-records", "x", "--run-dir", "y"], "argument --run-dir: not allowed with argument"),
    (["fit"], "one of the arguments --engine-records --run-dir is required"),
    (["plan", "--serve", "--batch", "4"], "unrecognized arguments: --batch 4"),
    (["fit", "--engine-records", "x", "--batch", "4"], "unrecognized arguments: --batch 4"),
    (["whatif", "--scale", "flops=inf"], "scale factor flops must be a number from 1e-06 to 1e+06, got inf"),
    (["collectives", "--backend", "nccl", "--sizes", "1024,4096"], "backend nccl"),
])
def test_conflicting_or_unused_options_are_errors(argv, expected, capsys):
    """Options that a command would ignore or that contradict each other are errors, not
    silently dropped: --profile with --efficiency, fit's two kinds of records, serving options
    on the commands that do not read them, an infinite what-if scale, NCCL without its GPUs."""
    if argv[0] == "collectives":
        import torch
        if torch.distributed.is_nccl_available() and torch.cuda.device_count() >= 2:
            pytest.skip("this machine runs NCCL")
    assert expected in _error(["perf", *argv], capsys)


def test_decode_batches_the_kv_cache_cannot_hold_are_marked(capsys):
    """`perf serve` still predicts a decode batch whose sequences the KV cache cannot hold, but
    marks it: 512 x 4,097 tokens of llama3-8b's KV cache (128 KiB a token) are ~275 GB."""
    from slipstream.cli import main

    argv = ["perf", "serve", "--model", "llama3-8b", "--batch", "1,512", "--context", "4096", "--json"]
    assert main(argv) == 0
    rows = {row["batch_size"]: row["fits"] for row in json.loads(capsys.readouterr().out)["decode"]}
    assert rows == {1: True, 512: False}


def test_measured_points_above_the_roof_are_flagged(tmp_path, capsys):
    """A record whose step is too short for its work lands above the roof: flagged in the table
    and the JSON, not printed as a fraction of the roof in the billions without a word."""
    from slipstream.cli import main

    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"kind": "engine_step", "phase": "decode", "batch_size": 1, "context_len": 64,
                                "step_s": 1e-12}) + "\n")
    assert main(["perf", "roofline", "--model", "tiny", "--records", str(path)]) == 0
    assert "ABOVE THE ROOF" in capsys.readouterr().out
    assert main(["perf", "roofline", "--model", "tiny", "--records", str(path), "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["above_roof"] for p in points if p["measured"]] == [True]
    assert not any(p["above_roof"] for p in points if not p["measured"])


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


def test_train_gpipe_holds_every_micro_batch_at_1f1bs_step_time(capsys):
    """`perf train --gpipe` prices GPipe's schedule: 1F1B's step time, and the memory the model
    gives a GPipe layout (every micro-batch's activations), more than 1F1B's; without --pp it is
    an error naming it."""
    from slipstream.cli import main

    runs = {}
    for extra in ([], ["--gpipe"]):
        assert main(["perf", "train", "--model", "llama3-8b", "--hardware", "h100", "--devices", "8",
                     "--pp", "4", "--global-batch", "32", "--seq-len", "4096", "--json", *extra]) == 0
        runs[bool(extra)] = json.loads(capsys.readouterr().out)
    assert runs[True]["layout"]["gpipe"]
    assert runs[True]["step_time_s"] == pytest.approx(runs[False]["step_time_s"])
    assert runs[True]["memory"]["activations_bytes"] > 2 * runs[False]["memory"]["activations_bytes"]
    assert "gpipe (GPipe's schedule) needs pp > 1" in _error(["perf", "train", "--gpipe"], capsys)


@pytest.mark.parametrize("argv, expected", [
    (["train", "--model", "gpt3-175b", "--devices", "1024", "--tp", "8", "--pp", "16", "--global-batch", "64",
      "--seq-len", "4096"], "--seq-len 4096 needs 4,096 positions, more than gpt3-175b's "
                            "max_position_embeddings (2,048)"),
    (["train", "--seq-len", "10000000", "--global-batch", "8"], "--seq-len 10000000 needs 10,000,000"),
    (["plan", "--model", "gpt3-175b", "--devices", "1024", "--seq-len", "2049"],
     "--seq-len 2049 needs 2,049"),
])
def test_seq_len_beyond_the_models_positions_is_refused(argv, expected, capsys):
    """GPT-3 learned 2,048 positions and Llama-3.1 8B has 131,072: a longer training sequence is
    refused naming --seq-len, as `perf serve` refuses a longer context."""
    assert expected in _error(["perf", *argv], capsys)


@pytest.mark.parametrize("sizes", ["1,2,3", "1024,1024", "4096"])
def test_collectives_need_two_distinct_message_sizes(sizes, capsys):
    """Sizes that repeat or round to the same fp32 message (1, 2 and 3 bytes over 2 ranks are all
    2 elements) fitted a line through one size: busbw `inf`, bare `Infinity` in --json. Refused
    before any process starts."""
    err = _error(["perf", "collectives", "--world-size", "2", "--sizes", sizes], capsys)
    assert f"--sizes {sizes}: the alpha-beta fit needs at least two distinct message sizes" in err


def test_a_failed_collective_fit_is_reported_not_infinite(monkeypatch):
    """Noisy timings where the larger message is faster clamp beta to 0: the table says
    "unbounded (fit failed)" with a warning and --json holds null, where it held Infinity."""
    import argparse

    from slipstream.perf import collectives_bench, commands
    from slipstream.perf.collectives_bench import Timing

    timings = [Timing("all_reduce", 65536, 2, 3.7e-3), Timing("all_reduce", 1048576, 2, 1.15e-3),
               Timing("broadcast", 65536, 2, 1e-4), Timing("broadcast", 1048576, 2, 1e-3)]
    monkeypatch.setattr(collectives_bench, "measure", lambda *a, **k: (timings, {"all_to_all": "no"}))
    args = argparse.Namespace(world_size=2, backend="gloo", sizes="65536,1048576", iterations=2)
    text, record = commands.collectives(args)
    json.dumps(record, allow_nan=False)
    fits = {f["collective"]: f for f in record["fits"]}
    assert fits["all_reduce"]["busbw_bytes_per_s"] is None and fits["broadcast"]["busbw_bytes_per_s"] > 0
    assert "all_reduce           2" in text and "unbounded (fit failed)" in text
    assert "warning: the all_reduce fit over 2 ranks failed" in text and "inf" not in text
    assert text.splitlines()[-1] == "not measured: all_to_all: no"
