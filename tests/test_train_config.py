"""The training config: TOML plus overrides, the resolved copy in the run dir, and bad configs
failing at start with a message that names the field."""

from __future__ import annotations

import re
import tomllib

import pytest

from slipstream.train.config import TrainConfig, check_run, load_config
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]


def test_toml_file_then_overrides(tmp_path):
    """Values come from the TOML file, overrides win, untouched keys keep their defaults."""
    path = tmp_path / "run.toml"
    path.write_text('[optimizer]\nlr = 3e-4\nbetas = [0.9, 0.99]\n[training]\nsteps = 50\n')
    config = load_config(path, ["--training.steps=7", "--data.path=some/dir", "--training.dtype=bfloat16"])
    assert config.optimizer.lr == 3e-4 and config.optimizer.betas == (0.9, 0.99)
    assert config.training.steps == 7 and config.training.dtype == "bfloat16"
    assert config.data.path == "some/dir"
    assert config.schedule == TrainConfig().schedule


def test_resolved_config_round_trips_through_toml(tmp_path):
    """`to_toml` is what the run dir gets, and reading it back gives an equal config."""
    config = load_config(None, ["--model.path=m", "--optimizer.eps=1e-10", "--logging.peak_flops_per_s=5e11"])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config


@pytest.mark.parametrize(("override", "message"), [
    ("--optimizer.lrr=1e-3", "unknown config key optimizer.lrr; did you mean optimizer.lr?"),
    ("--training.lr=1e-3", "did you mean optimizer.lr?"),
    ("--optimiser.lr=1e-3", "unknown config section [optimiser]; did you mean optimizer?"),
    ("--optimizer.lr=-1e-3", "optimizer.lr must be a positive number"),
    ("--training.steps=1.5", "training.steps must be int"),
    ("--training.dtype=fp16", "training.dtype must be one of float32, bfloat16"),
    ("--optimizer.betas=[0.9]", "optimizer.betas must be a list of 2 values"),
    ("--parallel.strategy=zero3", "parallel.strategy must be one of fsdp, ddp"),
    ("optimizer.lr", "must look like --section.key=value"),
    ("--run.dir=", "run.dir must be a directory path"),
    ("--training.seed=4294967296", "training.seed must be an integer in [0, 2**32)"),
    ("--data.seed=-1", "data.seed must be an integer in [0, 2**32)"),
    ("--supervisor.hang_timeout_s=1e300", "supervisor.hang_timeout_s must be a number of seconds in [0, "),
    ("--model.init_std=inf", "model.init_std must be a positive number"),
    ("--optimizer.weight_decay=inf", "optimizer.weight_decay must be a number >= 0"),
    ("--optimizer.eps=inf", "optimizer.eps must be a positive number"),
    ("--training.max_grad_norm=inf", "training.max_grad_norm must be a number >= 0"),
    ("--data.prefetch=1000000000", "data.prefetch must be at most 64"),
])
def test_bad_values_name_the_field(override, message):
    """Unknown keys suggest the closest valid one; bad values name the field and what is valid:
    also what would fail only inside a worker (a seed numpy refuses, a watchdog timer past the
    platform's), train into a NaN (an infinite init_std or weight decay) or zero every update (an
    infinite eps), or hold unbounded memory (prefetch)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, [override])


def test_unknown_key_in_a_toml_file(tmp_path):
    """The TOML file gets the same check as overrides."""
    path = tmp_path / "run.toml"
    path.write_text("[schedule]\nwarmup = 10\n")
    with pytest.raises(ValueError, match=r"schedule.warmup; did you mean schedule.warmup_steps\?"):
        load_config(path)


def test_batch_not_divisible_by_world_size(data_dir):
    """The global batch must split into micro-batches over the ranks; the message names it."""
    config = load_config(None, [f"--data.path={data_dir}", "--training.global_batch_size=12",
                                "--training.micro_batch_size=4"])
    check_run(config, world_size=3)
    with pytest.raises(ValueError, match=r"training.global_batch_size \(12\) must be divisible by "
                                         r"world size x training.micro_batch_size \(2 x 4 = 8\)"):
        check_run(config, world_size=2)


def test_bad_configs_fail_at_trainer_start(tmp_path, data_dir):
    """The trainer checks before building anything: missing data dir, indivisible batch."""
    missing = load_config(None, [f"--data.path={tmp_path / 'nope'}", f"--run.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="data.path .* holds no prepared dataset"):
        Trainer(missing)
    with pytest.raises(ValueError, match="data.path is required"):
        Trainer(load_config(None, [f"--run.dir={tmp_path / 'run'}"]))
    indivisible = load_config(None, [f"--data.path={data_dir}", "--training.global_batch_size=6",
                                     "--training.micro_batch_size=4", f"--run.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="training.global_batch_size"):
        Trainer(indivisible)
    assert not (tmp_path / "run").exists()


STRANGE_PATHS = ["runs/a\nb", "tab\there", "cr\rlf", "bell\x07\x1f\x7f", 'quote"and\\back', "données/走る/🙂"]


@pytest.mark.parametrize("path", STRANGE_PATHS)
def test_strings_with_control_characters_round_trip_through_toml(path, tmp_path):
    """Control characters (DEL included) are escaped and other characters kept, so the run dir's
    config.toml is valid TOML (tomllib is the reference) and reads back to the same config: a
    rerun with a path holding a newline resumes."""
    config = load_config(None, [f"--data.path={path}", f"--run.dir={path}/run", f"--model.path={path}"])
    text = config.to_toml()
    assert tomllib.loads(text)["data"]["path"] == path
    saved = tmp_path / "config.toml"
    saved.write_text(text, encoding="utf-8")
    assert load_config(saved) == config


def test_a_string_toml_cannot_hold_is_a_value_error():
    """A lone surrogate (an undecodable byte of a file name) has no TOML form."""
    config = load_config(None, ["--data.path=bad\udcffname"])
    with pytest.raises(ValueError, match="bad.udcffname"):
        config.to_toml()


def test_errors_from_a_config_file_name_the_file(tmp_path):
    """A file that is not UTF-8, or holds an unknown section or a bad value, is reported with its
    path: it may be the run dir's saved config.toml, which the command line does not name."""
    path = tmp_path / "config.toml"
    path.write_bytes(b"[data]\npath = \"caf\xe9\"\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not UTF-8 text"):
        load_config(path)
    path.write_text("[trainig]\nsteps = 5\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: unknown config section \\[trainig\\]"):
        load_config(path)
    path.write_text("[training]\nsteps = 0\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: training.steps must be a positive"):
        load_config(path)
    path.write_text("[training]\nsteps = 5\n")  # an override's error names no file
    with pytest.raises(ValueError, match="^training.steps must be a positive"):
        load_config(path, ["--training.steps=0"])


def test_an_override_fixes_a_bad_value_of_the_file(tmp_path):
    """Flags override the file before the config is checked (docs/training.md): a file value that
    a flag replaces is not an error (the file alone was checked first, and refused); a file
    value that stays wrong is one, naming the file, also with other flags given."""
    path = tmp_path / "config.toml"
    path.write_text("[training]\nsteps = 0\nglobal_batch_size = 8\n")
    assert load_config(path, ["--training.steps=10"]).training.steps == 10
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: training.steps must be a positive"):
        load_config(path, ["--training.micro_batch_size=4"])
