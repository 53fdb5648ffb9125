"""Shared pieces of the training tests: a small prepared dataset and a 2-layer model directory.

The dataset is 80 standard-library files tokenized with a 320-token BPE trained on them (about a
second), and the model a 2-layer Llama shape of 0.1M parameters with that vocabulary, so a
training step costs milliseconds and a two-process torchrun job a few seconds.

Test modules load this file as a plugin (`pytest_plugins`) so its session fixtures are built once,
and import its helpers; it holds no asserts (PYTEST_DONT_REWRITE).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.corpus import stdlib_files
from slipstream.model import ModelConfig, Transformer, save_model
from slipstream.model.tokenizer import Tokenizer, train_tokenizer
from slipstream.train.checkpoint import list_checkpoints, load_model_state
from slipstream.train.config import TrainConfig, load_config
from slipstream.train.data import Document, prepare_dataset
from slipstream.train.supervisor import torchrun_command

VOCAB_SIZE = 320
SEQ_LEN = 32
NUM_FILES = 80


def corpus() -> list[Document]:
    files = stdlib_files()
    picked = files[:: len(files) // NUM_FILES][:NUM_FILES]
    return [Document(f"stdlib/{p.name}-{i}", p) for i, p in enumerate(picked)]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A prepared dataset: train and val splits of the small corpus, 320-token tokenizer."""
    documents = corpus()
    tokenizer = train_tokenizer([d.path for d in documents], VOCAB_SIZE)
    out = tmp_path_factory.mktemp("train-data")
    prepare_dataset(out, tokenizer, documents, heldout_fraction=0.1, progress=False)
    return out


@pytest.fixture(scope="session")
def train_model_dir(tmp_path_factory, data_dir) -> Path:
    """A randomly initialised 2-layer model over the dataset's vocabulary (HF directory)."""
    return _model_dir(tmp_path_factory.mktemp("train-model"), data_dir, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory, data_dir) -> Path:
    """The same shape with the output projection tied to the embedding (as Llama-3.2-1B's)."""
    return _model_dir(tmp_path_factory.mktemp("tied-model"), data_dir, tie_word_embeddings=True)


def _model_dir(out: Path, data_dir: Path, *, tie_word_embeddings: bool) -> Path:
    return model_dir(out, data_dir, tie_word_embeddings=tie_word_embeddings)


def model_dir(out: Path, data_dir: Path, *, tie_word_embeddings: bool = False, model_type: str = "llama",
              vocab_size: int = VOCAB_SIZE, num_hidden_layers: int = 2, **fields) -> Path:
    """A randomly initialised model of `model_type` (HF directory, 2 layers unless told; `fields`:
    further `ModelConfig` fields) with the tokenizer of the dataset in `data_dir`."""
    config = ModelConfig(
        model_type=model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0, pad_token_id=0, tie_word_embeddings=tie_word_embeddings, **fields,
    )
    model = Transformer(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_model(model, out, dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((data_dir / "tokenizer" / name).read_bytes())
    return out


def small_config(data_dir: Path, train_model_dir: Path, run_dir: Path, *extra: str) -> TrainConfig:
    """A fast config over the fixtures; `extra` holds --section.key=value overrides."""
    return load_config(None, [
        f"--data.path={data_dir}", f"--model.path={train_model_dir}", f"--run.dir={run_dir}",
        f"--data.seq_len={SEQ_LEN}", "--training.global_batch_size=4",
        "--training.micro_batch_size=4", "--training.steps=5", "--schedule.warmup_steps=2",
        "--eval.interval=0", "--checkpoint.save_final=false", "--logging.tensorboard=false",
        "--logging.peak_flops_per_s=1e11", *extra,
    ])


def rerun_of_another_shape(data_dir: Path, source_dir: Path, tmp_path: Path,
                           rewrite: Callable[[dict], dict]) -> TrainConfig:
    """The config of a one-step run from a copy of the model dir `source_dir` (its final checkpoint
    saved, the launcher's check passed), whose model.path config.json has then been rewritten by
    `rewrite` (the same path: a rerun the launcher must check against the checkpoint's shape)."""
    from slipstream.train.supervisor import check_job
    from slipstream.train.trainer import Trainer

    model_dir = tmp_path / "model"
    shutil.copytree(source_dir, model_dir)
    config = small_config(data_dir, model_dir, tmp_path / "run", "--training.steps=1",
                          "--checkpoint.save_final=true")
    Trainer(config).run()
    check_job(config, 1)
    hf_config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(rewrite(hf_config)))
    return config


def train_with_torchrun(config: TrainConfig, work_dir: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """torchrun running `slipstream train` in N processes on `config`, written to work_dir/run.toml:
    the command `slipstream train --nproc N` runs, and a multi-host user runs, without the launcher
    process around it (its checks and run-dir lock are tested in test_cli and test_train_resilience;
    skipping it saves a torch import, seconds, per run). The finished process, its output captured."""
    (work_dir / "run.toml").write_text(config.to_toml())
    command = torchrun_command(nproc, 0, ["--config", str(work_dir / "run.toml")])
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


COMPARED_RUN = ("--training.deterministic=true", "--training.steps=8", "--training.global_batch_size=4",
                "--training.micro_batch_size=2", "--checkpoint.interval=4", "--checkpoint.save_final=true",
                "--eval.interval=4", "--eval.num_batches=2")
"""The runs the parallel layouts' tests compare with one process: 8 steps of 4 sequences of 32
tokens in 2 micro-batches of 2; checkpoints of steps 4 and 8."""


def torchrun_ok(config: TrainConfig, work_dir: Path, nproc: int = 2) -> None:
    """`train_with_torchrun` in `work_dir` (made if missing), which must exit 0."""
    work_dir.mkdir(exist_ok=True)
    result = train_with_torchrun(config, work_dir, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def assert_records_follow(run_dir: Path, reference: Path, label: str, loss_atol: float,
                          grad_norm_rtol: float | None = None) -> None:
    """`run_dir`'s train and eval losses within `loss_atol` of `reference`'s, record for record (a
    step redone after a resume: its later record), and its gradient norms within `grad_norm_rtol`
    of them, relatively (None: within `loss_atol`, as the losses)."""
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "eval_loss")):
        expected = {r["step"]: r[key] for r in read_metrics(reference, kind)}
        got = {r["step"]: r[key] for r in read_metrics(run_dir, kind)}
        assert got.keys() == expected.keys()
        if key == "grad_norm" and grad_norm_rtol is not None:
            diff = max(abs(got[s] - expected[s]) / expected[s] for s in got)
            print(f"{label} {key}: max relative difference {diff:.1e} over {len(got)} records")
            assert diff <= grad_norm_rtol
            continue
        diff = max(abs(got[s] - expected[s]) for s in got)
        print(f"{label} {key}: max difference {diff:.1e} over {len(got)} records")
        assert diff <= loss_atol


def max_weight_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between two checkpoints' weights (the same names in both)."""
    wa, wb = load_model_state(a), load_model_state(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def final_checkpoint(run_dir: Path) -> Path:
    """The run's newest checkpoint."""
    return list_checkpoints(run_dir)[-1][1]


def qwen2_style_tokenizer(files: list[Path], vocab_size: int, *, eos_token: str = "<|endoftext|>",
                          pad_token: str | None = "<|endoftext|>") -> Tokenizer:
    """A byte-level BPE trained on `files` with the pipeline of Qwen2's tokenizer.json (NFC, the
    Qwen2 split pattern taken from transformers, byte-level mapping without its own regex), which
    transformers' Qwen2Tokenizer rebuilds as it is; its special tokens are `eos_token`,
    <|im_start|> and <|im_end|>."""
    import tokenizers
    from tokenizers import decoders, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=[eos_token, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train([str(f) for f in files], trainer)
    special = {"eos_token": eos_token} | ({"pad_token": pad_token} if pad_token is not None else {})
    return Tokenizer(backend, special_tokens=special)
