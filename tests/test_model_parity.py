"""Parity of slipstream's decoder with Hugging Face transformers, in both directions."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from slipstream.model import ModelConfig, Transformer, load_model, save_model
from slipstream.model.config import RopeScaling

TOLERANCE_FP32 = 1e-4


def _batch(vocab_size: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def _positions(batch: int, seq: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + seq).expand(batch, seq)


@pytest.mark.parametrize("seq", [1, 5, 19])
def test_hf_checkpoint_loads_with_equal_logits(family, make_hf_model, tmp_path, seq):
    """A transformers checkpoint loaded by slipstream gives transformers' logits (fp32, 1e-4)."""
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = _batch(hf.config.vocab_size, 3, seq, seed=seq)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids, _positions(3, seq))
    diff = (expected - got).abs().max().item()
    print(f"{family} seq={seq}: max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE_FP32


def test_padded_batch_of_varied_lengths_matches_hf(family, make_hf_model, tmp_path):
    """Sequences of different lengths, batched by transformers with right padding and an attention
    mask, give the same logits at every real token as slipstream running each sequence alone."""
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    lengths = [3, 11, 17, 8]
    ids = _batch(hf.config.vocab_size, len(lengths), max(lengths), seed=11)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
        diffs = [
            (expected[i, :n] - ours(ids[i : i + 1, :n], _positions(1, n))[0]).abs().max().item()
            for i, n in enumerate(lengths)
        ]
    print(f"{family}: max |logit diff| per sequence = {[f'{d:.3g}' for d in diffs]}")
    assert max(diffs) < TOLERANCE_FP32


def test_positions_offset_matches_hf(family, make_hf_model, tmp_path):
    """Explicit positions that do not start at zero rotate exactly as transformers' position_ids."""
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = _batch(hf.config.vocab_size, 2, 9, seed=1)
    positions = torch.stack([_positions(1, 9, 100)[0], _positions(1, 9, 3000)[0]])
    with torch.no_grad():
        expected = hf(input_ids=ids, position_ids=positions).logits
        got = ours(ids, positions)
    diff = (expected - got).abs().max().item()
    print(f"{family}: max |logit diff| at offset positions = {diff:.3g}")
    assert diff < TOLERANCE_FP32


def test_slipstream_checkpoint_loads_in_transformers(family, family_config, tmp_path):
    """A model saved by slipstream is read by transformers with the same config and logits."""
    transformers = pytest.importorskip("transformers")
    config = family_config
    torch.manual_seed(0)
    ours = Transformer(config)
    ours.init_weights(std=0.1)
    save_model(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == config.to_hf_dict()["architectures"][0]
    ids = _batch(config.vocab_size, 2, 13, seed=7)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours.eval()(ids, _positions(2, 13))
    diff = (expected - got).abs().max().item()
    print(f"{family}: max |logit diff| slipstream -> transformers = {diff:.3g}")
    assert diff < TOLERANCE_FP32


def test_bf16_close_to_fp32_reference(family, make_hf_model, tmp_path):
    """Loading in bf16 converts every weight and stays close to the fp32 reference."""
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = _batch(hf.config.vocab_size, 2, 8, seed=3)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids, _positions(2, 8)).float()
    diff = (expected - got).abs().max().item()
    scale = expected.abs().max().item()
    print(f"{family}: bf16 max |logit diff| = {diff:.3g} (logit scale {scale:.3g})")
    assert diff < 0.05 * scale


def test_builds_on_meta_device(family_config):
    """The model builds on the meta device (no memory, no process group) and materialises."""
    config = family_config
    with torch.device("meta"):
        model = Transformer(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(_batch(config.vocab_size, 1, 4, 0), _positions(1, 4))
    assert logits.shape == (1, 4, config.vocab_size) and torch.isfinite(logits).all()


def test_loading_a_model_imports_no_compiler(tmp_path):
    """Building on the meta device computes nothing (no embedding initialisation, no RoPE
    frequencies), so loading a model for serving does not import torch._dynamo, which PyTorch
    does for normal_ or a division on meta (~1.5 s of the time to a first token). A fresh
    interpreter, since any earlier test may have imported it; the loaded RoPE frequencies are the
    model's own."""
    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, rope_scaling=RopeScaling(rope_type="linear", factor=2.0))
    model = Transformer(config)
    model.init_weights()
    save_model(model, tmp_path)
    script = textwrap.dedent(f"""
        import sys, torch
        from slipstream.model import load_model
        from slipstream.model.transformer import rope_inv_freq
        model = load_model({str(tmp_path)!r})
        assert "torch._dynamo" not in sys.modules, "loading imported torch._dynamo"
        assert torch.equal(model.model.rope.inv_freq, rope_inv_freq(model.config))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_forward_rejects_mismatched_shapes():
    """token_ids and positions of different shapes are a ValueError, not a broadcast."""
    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2)
    model = Transformer(config)
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(3)[None])
