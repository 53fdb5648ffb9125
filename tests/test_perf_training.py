"""Training model: Korthikanti activation memory, ZeRO, pipeline bubble, MFU, layout checks."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.perf.accelerators import get_accelerator
from slipstream.perf.memory import activation_bytes_per_layer, training_memory
from slipstream.perf.model import Layout, TrainSetup, predict_training, stage_layers
from slipstream.perf.shapes import GPT_SHAPES, resolve_model

A100, H100 = get_accelerator("a100"), get_accelerator("h100")
GPT175 = GPT_SHAPES["megatron-175b"]


def _setup(**kw) -> TrainSetup:
    base = dict(shape=GPT175, global_batch_size=64, seq_len=2048, micro_batch_size=1, dtype="fp16",
                attention="unfused", dropout=True)
    return TrainSetup(**(base | kw))


def test_activation_memory_matches_korthikanti_table2():
    """Guards activation bytes per layer against every row of Korthikanti et al. Table 2."""
    s, b, t = 2048, 1, 8
    h, a = GPT175.hidden_size, GPT175.num_heads
    sbh, n = s * b * h, s * b
    rows = {
        ("none", 1, False): sbh * (34 + 5 * a * s / h),
        ("none", t, False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", t, True): sbh * (34 / t + 5 * a * s / (h * t)),
        ("selective", t, False): sbh * (10 + 24 / t),
        ("selective", t, True): sbh * 34 / t,
        ("full", t, False): sbh * 2,
    }
    for (recompute, tp, sp), expected in rows.items():
        got = activation_bytes_per_layer(_setup(recompute=recompute), tp, sp, n)
        print(recompute, tp, sp, got / 2**30, "GiB")
        assert got == pytest.approx(expected, rel=1e-12)


def test_flash_and_no_dropout_remove_the_quadratic_term():
    """Guards the generalisation: no s^2 term with FlashAttention, 8 sbh less without masks."""
    n, sbh = 2048, 2048 * GPT175.hidden_size
    unfused = activation_bytes_per_layer(_setup(), 1, False, n)
    flash = activation_bytes_per_layer(_setup(attention="flash", dropout=False), 1, False, n)
    lse = 4 * n * GPT175.num_heads
    assert flash == pytest.approx(sbh * 32 + lse) and unfused > 3 * flash


def test_zero_stages_shard_optimizer_grads_weights():
    """Guards ZeRO (Rajbhandari et al.): stage 1 /dp optimizer, 2 also grads, 3 also weights."""
    setup = _setup(global_batch_size=64, recompute="selective")
    mems = [training_memory(setup, Layout(dp=8, tp=8, pp=8, zero_stage=z)) for z in range(4)]
    assert mems[1].optimizer_bytes == pytest.approx(mems[0].optimizer_bytes / 8)
    assert mems[2].gradients_bytes == pytest.approx(mems[1].gradients_bytes / 8)
    assert mems[3].weights_bytes == pytest.approx(mems[2].weights_bytes / 8)
    per_param = (setup.weight_bytes + setup.grad_bytes + setup.optimizer_bytes)
    params = mems[0].weights_bytes / setup.weight_bytes
    assert mems[0].weights_bytes + mems[0].gradients_bytes + mems[0].optimizer_bytes == pytest.approx(
        per_param * params)


def test_pipeline_bubble_follows_narayanan():
    """Guards the bubble: (p - 1) / (v m) of the ideal pipeline time, 1F1B and interleaved."""
    shape = dataclasses.replace(GPT175, vocab_size=8)  # negligible logits: uniform stages
    for v in (1, 3):
        setup = _setup(shape=shape, global_batch_size=32, recompute="selective")
        p = predict_training(setup, Layout(tp=8, pp=8, virtual_stages=v, sequence_parallel=True,
                                           zero_stage=0), A100)
        ratio = p.breakdown_s["bubble_s"] / p.breakdown_s["pipeline_s"]
        print(f"v={v}: bubble / pipeline = {ratio:.4f}, closed form {(8 - 1) / (v * 32):.4f}")
        assert ratio == pytest.approx((8 - 1) / (v * 32), rel=0.05)


def test_mfu_is_palm_model_flops_over_peak():
    """Guards MFU: tokens/s x (6N + 12 L H Q T) / (N_devices x dense peak); HFU adds recompute."""
    setup = _setup(recompute="full")
    p = predict_training(setup, Layout(tp=8, pp=8, virtual_stages=3, zero_stage=0), A100)
    flops = setup.tokens_per_step * GPT175.train_flops_per_token(2048)
    assert p.mfu == pytest.approx(flops / p.step_time_s / (64 * 312e12))
    assert p.hfu == pytest.approx(p.mfu * 4 / 3)
    assert p.tokens_per_s == pytest.approx(64 * 2048 / p.step_time_s)


def test_recompute_trades_time_for_memory():
    """Guards the direction of each recompute mode: full is slowest and smallest."""
    layout = Layout(tp=8, pp=8, virtual_stages=3, sequence_parallel=True, zero_stage=0)
    preds = {r: predict_training(_setup(recompute=r), layout, A100) for r in ("none", "selective", "full")}
    assert preds["none"].step_time_s < preds["selective"].step_time_s < preds["full"].step_time_s
    mem = {r: p.memory.activations_bytes for r, p in preds.items()}
    assert mem["none"] > mem["selective"] > mem["full"]


def test_data_parallel_overlap_and_fsdp():
    """Guards that unoverlapped DP costs time, and FSDP saves memory over ZeRO-1."""
    shape = resolve_model("llama3-8b")
    setup = TrainSetup(shape=shape, global_batch_size=64, seq_len=4096, dp_overlap=False)
    overlapped = dataclasses.replace(setup, dp_overlap=True)
    layout = Layout(dp=8, tp=8, zero_stage=1, sequence_parallel=True)
    exposed = predict_training(setup, layout, H100).step_time_s
    assert exposed > predict_training(overlapped, layout, H100).step_time_s
    fsdp = predict_training(overlapped, dataclasses.replace(layout, zero_stage=3), H100)
    assert fsdp.memory.weights_bytes < predict_training(overlapped, layout, H100).memory.weights_bytes


def test_uneven_pipeline_puts_spare_slots_on_the_ends():
    """Guards Llama 3's split: 126 layers on 16 stages x 8 chunks, one fewer on first and last."""
    assert stage_layers(126, Layout(pp=16, virtual_stages=8, dp=1)) == (7, 8, 7)
    assert stage_layers(96, Layout(pp=8, virtual_stages=3)) == (12, 12, 12)


def test_bad_layouts_are_value_errors():
    """Guards user errors: batch not divisible, TP not dividing heads, SP without TP."""
    with pytest.raises(ValueError, match="not a multiple"):
        predict_training(_setup(global_batch_size=6), Layout(dp=4, tp=8, zero_stage=0), A100)
    with pytest.raises(ValueError, match="tp=7"):
        predict_training(_setup(), Layout(tp=7), A100)
    with pytest.raises(ValueError, match="sequence_parallel needs tp"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute must be"):
        _setup(recompute="some")
