"""User errors and overlapping folders caught before they cost a run or a dataset: a run dir that
would write over the dataset, a tokenizer folder the run did not write, a damaged dataset
tokenizer, the checks a launcher makes before it starts any worker, and a warm-up longer than
the run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from train_fixtures import corpus, model_dir, read_metrics, small_config

from slipstream.cli import main
from slipstream.model.tokenizer import Tokenizer, train_tokenizer
from slipstream.train.config import ScheduleConfig
from slipstream.train.data import prepare_dataset
from slipstream.train.optim import WarmupDecay
from slipstream.train.supervisor import check_job
from slipstream.train.trainer import Trainer, copy_tokenizer

pytest_plugins = ["train_fixtures"]


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_run_dir_that_overlaps_the_dataset_is_refused(data_dir, train_model_dir, tmp_path):
    """run.dir equal to data.path (the trainer replaced the dataset's tokenizer with a copy of
    itself: deleted it, then failed), inside its tokenizer folder, or holding the dataset in
    RUN_DIR/tokenizer is refused up front, by the launcher's checks and the trainer's, naming
    both keys; the dataset is left as it was."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    nested = tmp_path / "run" / "tokenizer" / "data"
    shutil.copytree(data_dir, nested)
    (tmp_path / "link").symlink_to(data)
    before = _tree(data)
    for data_path, run_dir in ((data, data), (data, tmp_path / "link"), (data, data / "tokenizer" / "run"),
                               (nested, tmp_path / "run")):
        config = small_config(data_path, train_model_dir, run_dir)
        for check in (lambda c: check_job(c, 1), Trainer):
            with pytest.raises(ValueError, match=r"run.dir .* and data.path .* overlap"):
                check(config)
    assert _tree(data) == before
    assert main(["train", f"--data.path={data}", f"--run.dir={data}", "--training.steps=1"]) == 2
    assert _tree(data) == before


def _exited_pid() -> int:
    """The id of a process that has ended, as a killed writer's is."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_run_replaces_only_a_tokenizer_copy_it_wrote(data_dir, tmp_path):
    """RUN_DIR/tokenizer is replaced only when it holds nothing but tokenizer files (an earlier
    attempt's copy); a folder with other files, or a symbolic link, is left alone (ValueError)."""
    source = data_dir / "tokenizer"
    target = tmp_path / "tokenizer"
    old_umask = os.umask(0o022)
    try:
        copy_tokenizer(source, target)
        assert stat.S_IMODE(target.stat().st_mode) == 0o755  # as the mkdir of a copytree, not mkdtemp's 0700
        (target / "tokenizer.json").write_text("stale")
        killed = tmp_path / f".tmp-tokenizer-{_exited_pid()}-0123abcd"  # what a killed attempt leaves
        killed.mkdir()
        (killed / "tokenizer.json").write_text("half")
        copy_tokenizer(source, target)
        assert stat.S_IMODE(target.stat().st_mode) == 0o755
    finally:
        os.umask(old_umask)
    assert _tree(target) == _tree(source)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer"]  # no staging folder left behind
    foreign = tmp_path / "other" / "tokenizer"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not a tokenizer folder a run wrote .*notes.txt"):
        copy_tokenizer(source, foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    link = tmp_path / "linked" / "tokenizer"
    link.parent.mkdir()
    link.symlink_to(foreign)
    with pytest.raises(ValueError, match="not a tokenizer folder a run wrote"):
        copy_tokenizer(source, link)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_prepare_restores_a_missing_or_replaced_tokenizer(data_dir, tmp_path):
    """Preparing a dataset again repairs its tokenizer folder when it is missing, lacks a file or
    holds another tokenizer (its SHA-256 is in meta.json), as it repairs damaged split files; a
    dataset that is whole is left untouched."""
    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    out = tmp_path / "data"
    current_umask = os.umask(0o022)
    os.umask(current_umask)
    prepare_dataset(out, tokenizer, corpus(), heldout_fraction=0.1, progress=False)
    whole = _tree(out)
    other = train_tokenizer([d.path for d in corpus()[:10]], 300)
    for damage in (lambda t: shutil.rmtree(t), lambda t: (t / "generation_config.json").unlink(),
                   lambda t: other.save_pretrained(t), lambda t: (t / "tokenizer.json").write_text("{")):
        damage(out / "tokenizer")
        (out / f".tmp-tokenizer-{_exited_pid()}-0123abcd").mkdir()  # what a killed repair leaves
        prepare_dataset(out, tokenizer, corpus(), heldout_fraction=0.1, progress=False)
        assert _tree(out) == whole
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
        assert stat.S_IMODE((out / "tokenizer").stat().st_mode) == 0o777 & ~current_umask
    assert json.loads((out / "meta.json").read_text())["tokenizer_sha256"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"model": {"path": None, "preset": "huge"}}, "unknown preset 'huge'"),
    ({"model": {"path": None, "preset": "llama3.2-1b"}}, "planning shape too large to train"),
    ({"data": {"seq_len": 512}}, r"data.seq_len \(512\) exceeds the model's max_position_embeddings \(256\)"),
    ({"training": {"global_batch_size": 100000, "micro_batch_size": 100000}},
     "fewer than one step of 100000 windows"),
])
def test_the_launcher_checks_the_model_and_data_before_any_worker(changes, message, data_dir,
                                                                  train_model_dir, tmp_path):
    """What every worker would raise on every restart (torchrun tracebacks in a loop) is one
    ValueError from `check_job`, and `slipstream train --max-restarts` exits 2 with it before
    starting torchrun."""
    config = small_config(data_dir, train_model_dir, tmp_path / "run").replace(**changes)
    with pytest.raises(ValueError, match=message):
        check_job(config, 1)
    path = tmp_path / "job.toml"
    path.write_text(config.to_toml())
    assert main(["train", "--max-restarts", "1", "--config", str(path)]) == 2
    assert not (tmp_path / "run").exists()


def test_the_launcher_checks_the_vocabulary_device_and_backend(data_dir, tmp_path):
    """A model vocabulary smaller than the data's tokenizer, CUDA without a CUDA device, and NCCL
    on CPU ranks are refused by `check_job`, before torchrun."""
    small_vocab = model_dir(tmp_path / "model", data_dir, vocab_size=100)
    with pytest.raises(ValueError, match=r"model.path has a vocabulary of 100 tokens.* tokenized with 320"):
        check_job(small_config(data_dir, small_vocab, tmp_path / "run"), 1)
    config = small_config(data_dir, data_dir.parent, tmp_path / "run").replace(model={"path": None})
    nccl = config.replace(parallel={"backend": "nccl"}, training={"device": "cpu", "micro_batch_size": 2})
    with pytest.raises(ValueError, match="parallel.backend is 'nccl', which needs CUDA devices"):
        check_job(nccl, 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="training.device is 'cuda' but no CUDA device"):
            check_job(config.replace(training={"device": "cuda"}), 1)


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_a_warning(data_dir, train_model_dir, tmp_path,
                                                                   caplog):
    """As torchtitan: schedule.warmup_steps beyond training.steps is clamped to the step count (the
    warm-up spans the run, reaching steps / (steps + 1) of the peak, not steps / (warmup + 1)),
    and a warm-up as long as the run or longer is warned about; a shorter one is unchanged."""
    assert [WarmupDecay(ScheduleConfig(warmup_steps=100), 5)(s) for s in range(5)] == [
        (s + 1) / 6 for s in range(5)]
    assert [WarmupDecay(ScheduleConfig(warmup_steps=2), 5)(s) for s in range(2)] == [1 / 3, 2 / 3]
    with caplog.at_level(logging.WARNING, logger="slipstream.train.trainer"):
        Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--schedule.warmup_steps=10")).run()
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert lrs == pytest.approx([1e-3 * (s + 1) / 6 for s in range(5)])
    assert "schedule.warmup_steps (10) >= training.steps (5)" in caplog.text
    assert "cut to 5 steps, so a resume that extends training.steps warms up longer" in caplog.text
    assert not hasattr(WarmupDecay(ScheduleConfig(warmup_steps=100), 5), "warmup_clamped")


@pytest.mark.slow  # ~15 s of torchrun for one log line
def test_the_warmup_warning_is_logged_once_per_job(data_dir, train_model_dir, tmp_path):
    """Under torchrun (2 ranks, gloo) the warning comes from the main rank only, not once per rank."""
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--schedule.warmup_steps=10",
                          "--training.steps=2", "--training.micro_batch_size=2")
    (tmp_path / "run.toml").write_text(config.to_toml())
    result = subprocess.run([sys.executable, "-m", "slipstream.cli", "train", "--nproc", "2",
                             "--config", str(tmp_path / "run.toml")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("schedule.warmup_steps (10) >= training.steps (2)") == 1


def test_the_launcher_checks_that_the_config_can_be_saved(data_dir, train_model_dir, tmp_path):
    """A run.dir with a byte that is not UTF-8 (a surrogate in Python's str) cannot be written to
    the run's config.toml: every worker would raise that on every restart, so `check_job` does."""
    run_dir = str(tmp_path / "run") + "\udcff"
    config = small_config(data_dir, train_model_dir, tmp_path / "run").replace(run={"dir": run_dir})
    with pytest.raises(ValueError, match="cannot be written to the run's config.toml"):
        check_job(config, 1)
