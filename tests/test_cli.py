"""The `slipstream` command as a user runs it: the README's main job, calibration, and the
checks `slipstream train` makes before it starts anything."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from train_fixtures import small_config

from slipstream.perf import hardware
from slipstream.perf.hardware import multiplies_bf16

pytest_plugins = ["train_fixtures"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache (calibration, tokenizers) shared by the tests here, isolated from the user's but
    for the compiled CPU kernels: those are keyed by their sources, flags and compiler, and a
    build costs ~15 s."""
    cache = tmp_path_factory.mktemp("cache")
    kernels = hardware.cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "slipstream").mkdir()
    (cache / "slipstream" / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


def _run(*args: str, cache_dir) -> subprocess.CompletedProcess:
    env = os.environ | {"XDG_CACHE_HOME": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "slipstream.cli", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_demo_trains_exports_and_generates(tmp_path, cache_dir):
    """`slipstream demo` (the README's main job), shortened to 2 steps on 60 corpus files (one
    evaluation batch held out; at 200 files, five batches at each of three evaluations): the
    loss starts near ln(vocab) (random weights) and falls, the run is exported and the engine
    completes every prompt, it trains in bf16 only where the CPU multiplies bf16, and throughput
    and MFU are positive (MFU's upper end depends on the calibration having run on an idle
    machine, so it is not checked here)."""
    result = _run("demo", "--workdir", str(tmp_path / "demo"), "--max-steps", "2",
                  "--max-documents", "60", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["tokens_trained"] == 2 * 8 * 256
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


def _train_config(tmp_path, data_dir, train_model_dir, *extra: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(small_config(data_dir, train_model_dir, tmp_path / "run", *extra).to_toml())
    return str(path)


@pytest.mark.parametrize("flag, value", [("--nproc", "0"), ("--nproc", "-3"), ("--max-restarts", "-1")])
def test_train_process_counts_out_of_range_are_errors(flag, value, cache_dir):
    """`--nproc` below 1 and `--max-restarts` below 0 are errors naming the flag, not a
    single-process run."""
    result = _run("train", flag, value, "--data.path=unused", cache_dir=cache_dir)
    assert result.returncode == 2
    assert f"argument {flag}: must be an integer >= " in result.stderr and repr(value) in result.stderr


# The two tests below call the command's `main` in this process: the checks fail before anything
# is started (a subprocess would only add seconds of torch import to each).
@pytest.mark.parametrize("launch, rank", [((), 7), (("--nproc", "2"), 2)])
def test_faults_rank_outside_the_job_is_an_error(launch, rank, tmp_path, data_dir, train_model_dir, capsys):
    """A fault aimed at a rank the job does not have would never fire: an error naming it."""
    from slipstream.cli import main

    config = _train_config(tmp_path, data_dir, train_model_dir, "--training.micro_batch_size=2")
    assert main(["train", "--config", config, *launch, f"--faults.rank={rank}"]) == 2
    assert f"faults.rank ({rank}) must be below the job's number of ranks" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_launcher_checks_the_job_before_starting_workers(tmp_path, data_dir, train_model_dir, capsys):
    """Under `--nproc 2 --max-restarts 3`, a data dir without train.bin and a global batch the
    ranks cannot split are one-line errors with status 2 before any worker starts (as without
    --nproc), not a restart loop ending in torchrun's ChildFailedError."""
    from slipstream.cli import main

    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    (broken / "train.bin").unlink()
    config = _train_config(tmp_path, data_dir, train_model_dir)
    for extra, expected in [((f"--data.path={broken}", "--training.micro_batch_size=2"), "train.bin"),
                            ((), "training.global_batch_size (4) must be divisible")]:
        assert main(["train", "--config", config, "--nproc", "2", "--max-restarts", "3", *extra]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("slipstream train: error: ") and expected in line, line
    assert not (tmp_path / "run").exists()  # nothing launched


def _bench_error(capsys, *args: str) -> str:
    """The error `slipstream bench serve ARGS` prints, after checking it exits 2 without a traceback."""
    from slipstream.cli import main

    with pytest.raises(SystemExit) as exit_info:  # argparse errors exit from inside main
        raise SystemExit(main(["bench", "serve", "--model", "m", *args]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:99999", "'http://127.0.0.1:99999' is not a valid URL: Port out of range"),
    ("http://[::1", "'http://[::1' is not a valid URL"),
    ("localhost:8000", "base_url must look like http://HOST:PORT, got 'localhost:8000'"),
])
def test_bench_serve_bad_base_url_is_an_error(url, expected, capsys):
    """A port out of range or a malformed URL is an error naming the URL, before any request
    (not an OverflowError inside an ExceptionGroup or httpx.InvalidURL)."""
    assert expected in _bench_error(capsys, "--base-url", url)


@pytest.mark.parametrize("dataset, expected", [
    ("[1, 2]", "entry 0 is not {'conversations'"),
    ('[{"conversations": "abc"}]', "entry 0 is not {'conversations'"),
    ('[{"conversations": [{"value": 1}, {"value": "x"}]}]', "entry 0 is not"),
    ('{"conversations": []}', "must hold a JSON list of"),
    ("[{", "is not valid JSON"),
])
def test_bench_serve_malformed_sharegpt_file_is_an_error_naming_it(dataset, expected, data_dir, tmp_path,
                                                                 capsys):
    """A ShareGPT file that is not a list of conversations of text turns is an error naming the
    file and the entry (not an AttributeError or a TypeError)."""
    path = tmp_path / "sharegpt.json"
    path.write_text(dataset)
    err = _bench_error(capsys, "--base-url", "http://127.0.0.1:1", "--tokenizer", str(data_dir / "tokenizer"),
                       "--dataset-name", "sharegpt", "--dataset-path", str(path))
    assert str(path) in err and expected in err, err


@pytest.mark.parametrize("args, expected", [
    (["--goodput", "ttft:nan"], "goodput SLOs are"),
    (["--sharegpt-output-len", "0"], "sharegpt_output_len must be >= 1, got 0"),
    (["--save-result", "/"], "result file /: not a file path in a writable directory"),
    (["--save-result", "/no/such/dir/r.json"], "not a file path in a writable directory"),
    (["--save-result", "--result-filename", "/no/such/dir/r.json"], "not a file path in a writable"),
])
def test_bench_serve_values_it_would_misread_or_fail_on_at_the_end_are_errors(args, expected, data_dir,
                                                                               capsys):
    """A NaN SLO (which passed `<= 0`), a ShareGPT length of 0 (read as "not set") and a result
    path that cannot be written (found only after the whole run) are errors before any request."""
    err = _bench_error(capsys, "--base-url", "http://127.0.0.1:1", "--tokenizer", str(data_dir / "tokenizer"),
                       *args)
    assert expected in err, err


def test_file_system_errors_and_unusable_arguments_are_one_line_errors(tmp_path, capsys):
    """A path under a file, a non-empty export target without --overwrite, a planning-only demo
    preset and a demo of 0 documents are one line and status 2 (were tracebacks, a silent
    overwrite, or errors only after the data was prepared), with nothing written."""
    from slipstream.cli import main

    (tmp_path / "afile").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("")
    cases = [
        (["init-model", str(tmp_path / "afile" / "sub")], "slipstream init-model: error: [Errno"),
        (["export", str(tmp_path), str(tmp_path / "full")], "slipstream export: error:"),
        (["demo", "--workdir", str(tmp_path / "demo"), "--preset", "llama3-8b"], "planning shape"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--workdir", str(tmp_path / "demo"), "--max-documents", "0"])
    assert exit_info.value.code == 2 and "--max-documents: must be an integer >= 2" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists() and (tmp_path / "full" / "keep.txt").exists()


def test_bench_serve_against_a_silent_server_fails_after_the_ready_timeout(data_dir, capsys):
    """A port that accepts connections but never answers fails the initial test request after
    `--ready-timeout` seconds with an error saying so, instead of waiting the run's 6 hours."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as server:  # the kernel accepts; nobody answers
        port = server.getsockname()[1]
        start = time.monotonic()
        err = _bench_error(capsys, "--base-url", f"http://127.0.0.1:{port}", "--tokenizer",
                           str(data_dir / "tokenizer"), "--num-prompts", "1", "--random-input-len", "8",
                           "--random-output-len", "2", "--ready-timeout", "1", "--disable-tqdm")
    assert time.monotonic() - start < 30
    assert f"the initial test request to http://127.0.0.1:{port} failed" in err
    assert "no response within 1.0 s" in err, err
    assert "must be a number > 0, got '0'" in _bench_error(capsys, "--base-url", "http://h:1",
                                                           "--ready-timeout", "0")
