"""Training Gemma 2: the tiny-gemma2 preset trains (loss falls) and resumes bit for bit; tensor
parallelism (2 ranks, gloo) with sequence parallelism splits the sandwich norms' layer and follows
one process; slow: the same without sequence parallelism and with activation checkpointing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_fixtures import read_metrics, small_config, train_with_torchrun

from slipstream.model import ModelConfig
from slipstream.model.transformer import SandwichDecoderLayer, Transformer
from slipstream.model.weights import save_model
from slipstream.train.checkpoint import checkpoint_dir, load_model_state
from slipstream.train.config import load_config
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

RUN = ("--training.deterministic=true", "--training.steps=6", "--training.global_batch_size=4",
       "--training.micro_batch_size=2", "--checkpoint.interval=3", "--checkpoint.save_final=true")
LOSS_ATOL = WEIGHT_ATOL = 1e-5
"""As tests/test_train_tp.py: fp32 partial sums added in another order, far below a wrong split."""


def gemma2_model_dir(out: Path, data_dir: Path) -> Path:
    """A 2-layer Gemma 2 (a windowed layer, then a full one; soft-capped scores and logits; 4 query
    heads, 2 K/V heads) with its norm weights set off zero, so that a wrongly split norm shows in
    the losses, and the dataset's tokenizer."""
    config = ModelConfig(
        model_type="gemma2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=8, layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = Transformer(config)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_model(model, out, dtype="float32")
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.empty_like(tensor).uniform_(-0.5, 0.5, generator=generator)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((data_dir / "tokenizer" / name).read_bytes())
    return out


def test_the_tiny_gemma2_preset_trains_and_resumes_bit_for_bit(data_dir, tmp_path):
    """`model.preset=tiny-gemma2` builds Gemma 2's layers, its loss falls over 6 steps (a model
    that learns nothing would stay near ln V), and a run resumed from its step-3 checkpoint ends
    with the same losses and weights, bit for bit."""
    def config(run_dir: Path):
        return load_config(None, [
            f"--data.path={data_dir}", f"--run.dir={run_dir}", "--model.preset=tiny-gemma2",
            "--data.seq_len=32", "--training.global_batch_size=2", "--training.micro_batch_size=2",
            "--training.steps=6", "--training.deterministic=true", "--schedule.warmup_steps=1",
            "--optimizer.lr=3e-3", "--eval.interval=0", "--checkpoint.interval=3",
            "--checkpoint.save_final=true", "--logging.tensorboard=false", "--logging.peak_flops_per_s=1e11",
        ])

    whole = Trainer(config(tmp_path / "whole"))
    assert all(isinstance(layer, SandwichDecoderLayer) for layer in whole.model.model.layers)
    whole.run()
    losses = [r["loss"] for r in read_metrics(tmp_path / "whole")]
    print("tiny-gemma2 losses", [round(x, 3) for x in losses])
    assert losses[-1] < losses[0] - 0.5
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(checkpoint_dir(tmp_path / "cut", 6))  # as if it had died after step 3
    Trainer(config(tmp_path / "cut")).run()
    assert read_metrics(tmp_path / "cut", "resume")[0]["step"] == 3
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "cut")}  # step 4 on: the later record
    assert [resumed[s] for s in range(1, 7)] == losses
    a, b = (load_model_state(checkpoint_dir(tmp_path / name, 6)) for name in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ~12 s each (two launches): slow. The default set keeps Gemma 2's sandwich layers under tensor
# parallelism in serving (test_gemma_serving.py) and the TP training plan on Llama (test_train_tp.py).
@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    (), ("--parallel.sequence_parallel=false", "--parallel.activation_checkpointing=true"),
], ids=["sequence-parallel", "replicated-norms-checkpointing"])
def test_tensor_parallel_gemma2_follows_one_process(extra, data_dir, tmp_path):
    """TP=2 over 2 ranks of Gemma 2 (its four norms per layer on sequence shards, or replicated
    without sequence parallelism; soft-capped attention on each rank's heads; a windowed layer):
    train losses and final weights within LOSS_ATOL and WEIGHT_ATOL of one process."""
    source = gemma2_model_dir(tmp_path / "model", data_dir)
    one = tmp_path / "one"
    Trainer(small_config(data_dir, source, one, *RUN)).run()
    config = small_config(data_dir, source, tmp_path / "tp", *RUN, "--parallel.tensor_parallel_degree=2",
                          *extra)
    result = train_with_torchrun(config, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, records = read_metrics(one), read_metrics(tmp_path / "tp")
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, records, strict=True))
    weights, expected = (load_model_state(checkpoint_dir(run_dir, 6)) for run_dir in (tmp_path / "tp", one))
    weight_diff = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    print(f"TP=2 gemma2 {extra}: max loss difference {diff:.1e}, weights {weight_diff:.1e}")
    assert len(records) == len(reference) == 6
    assert weights.keys() == expected.keys()
    assert diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL
