"""The performance model of mixture-of-experts models against real models, torch's FLOP counter,
published parameter counts and a Monte Carlo simulation of routing."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from unittest import mock

import pytest
import torch
from dispatch_passes import NonMatmulPasses
from test_perf_training import _gpt_oss_config, _trainer_saved_activation_bytes
from torch.utils.flop_counter import FlopCounterMode

from slipstream.model.config import ModelConfig
from slipstream.model.transformer import MLP, GptOssExperts, SparseMoeBlock, Transformer, route
from slipstream.perf import flops
from slipstream.perf.efficiency import Efficiency
from slipstream.perf.hardware import get_accelerator
from slipstream.perf.layers import Device, LayerSpec, layer_gemms, pointwise_backward, pointwise_forward
from slipstream.perf.memory import activation_bytes_per_layer, training_memory
from slipstream.perf.model import Layout, TrainSetup, predict_training
from slipstream.perf.serving import ServeSetup, step_time
from slipstream.perf.shapes import TransformerShape

_ATTENTION = dict(vocab_size=96, hidden_size=48, num_attention_heads=4, num_key_value_heads=2)

# Every MoE switch: Mixtral (every layer routed, experts intermediate_size wide), Qwen3-MoE (dense
# layers between routed ones, q/k norms), Qwen2-MoE (shared expert and its gate, q/k/v biases, a
# dense layer named in mlp_only_layers, tied embeddings).
MOE_CONFIGS = {
    "mixtral": ModelConfig(model_type="mixtral", intermediate_size=40, num_hidden_layers=2,
                           num_experts=4, num_experts_per_tok=2, **_ATTENTION),
    "qwen3_moe-sparse-step": ModelConfig(model_type="qwen3_moe", intermediate_size=72, num_hidden_layers=4,
                                         num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                         decoder_sparse_step=2, head_dim=16, **_ATTENTION),
    "qwen2_moe-shared": ModelConfig(model_type="qwen2_moe", intermediate_size=72, num_hidden_layers=3,
                                    num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20,
                                    shared_expert_intermediate_size=56, mlp_only_layers=(1,),
                                    norm_topk_prob=True, tie_word_embeddings=True, **_ATTENTION),
}
H100 = get_accelerator("h100")


def _model(config: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # routing that differs from token to token
    return model


def _expert_blocks(model: Transformer) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _hand_active_params(model: Transformer, config: ModelConfig) -> int:
    """Every parameter of the model less, in each MoE block, the experts past the first k (all
    experts are the same size, so any k of them are a token's)."""
    idle = sum(p.numel() for block in _expert_blocks(model)
               for expert in block.experts[config.num_experts_per_tok:] for p in expert.parameters())
    return sum(p.numel() for p in model.parameters()) - idle


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_parameter_counts_equal_the_model(name):
    """Guards total parameters (every expert, router, shared expert and gate) against the real
    model's `sum(p.numel())`, and active parameters against a count of the model's tensors."""
    config = MOE_CONFIGS[name]
    model = _model(config)
    total = sum(p.numel() for p in model.parameters())
    shape = TransformerShape.from_model_config(config)
    active = _hand_active_params(model, config)
    print(f"{name}: total {total}, active {active}, formula {flops.num_params(config)}, "
          f"{flops.active_params(config)}")
    assert len(_expert_blocks(model)) == len(shape.moe_layers) == flops.num_moe_layers(config) > 0
    assert flops.num_params(config) == shape.num_params() == total
    assert flops.active_params(config) == shape.active_params() == active < total
    embedding = model.model.embed_tokens.weight.numel()
    assert flops.num_params(config, include_embedding=False) == total - embedding
    assert flops.active_params(config, include_embedding=False) == active - embedding


def test_active_parameters_by_hand():
    """Guards active_params against the tiny Mixtral counted by hand: per layer q, k, v, o (48 x 48,
    48 x 24 twice, 48 x 48), two norms of 48, the router 48 x 4 and 2 of the 4 experts (3 x 48 x
    40 each); then the embedding and lm_head (96 x 48 each) and the final norm."""
    layer = (48 * 48 + 2 * 48 * 24 + 48 * 48) + 2 * 48 + 48 * 4 + 2 * (3 * 48 * 40)
    assert flops.active_params(MOE_CONFIGS["mixtral"]) == 2 * layer + 2 * 96 * 48 + 48
    assert flops.num_params(MOE_CONFIGS["mixtral"]) == 2 * (layer + 2 * 3 * 48 * 40) + 2 * 96 * 48 + 48


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_parameter_counts_equal_transformers(family):
    """Guards the counts against transformers' own MoE classes, an independent implementation."""
    transformers = pytest.importorskip("transformers")
    config = {"mixtral": MOE_CONFIGS["mixtral"], "qwen3_moe": MOE_CONFIGS["qwen3_moe-sparse-step"],
              "qwen2_moe": MOE_CONFIGS["qwen2_moe-shared"]}[family]
    with torch.device("meta"):
        hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert flops.num_params(config) == sum(p.numel() for p in hf.parameters())


def test_published_total_and_active_parameters():
    """Guards the counts against the model cards: Mixtral-8x7B 46.7B total / 12.9B active (Mistral
    AI), Qwen3-30B-A3B 30.5B / 3.3B and 29.9B without embeddings, Qwen1.5-MoE-A2.7B (a shared
    expert) 14.3B / 2.7B (Qwen), from their config.json, to the printed digit (Qwen3's 3.3B active
    is 3.35B cut, not rounded)."""
    mixtral = ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          num_experts=8, num_experts_per_tok=2)
    qwen3 = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                        norm_topk_prob=True)
    qwen15 = ModelConfig(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                         num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                         shared_expert_intermediate_size=5632)
    published = ((mixtral, 46.7e9, (12.85e9, 12.95e9)), (qwen3, 30.5e9, (3.3e9, 3.4e9)),
                 (qwen15, 14.3e9, (2.65e9, 2.75e9)))
    for config, total, active in published:
        print(config.model_type, flops.num_params(config), flops.active_params(config))
        assert abs(flops.num_params(config) - total) < 0.05e9
        assert active[0] <= flops.active_params(config) < active[1]
    # Qwen's "non-embedding" count leaves out the lm_head too; ours (torchtitan's) only the input table
    without_head = flops.num_params(qwen3, include_embedding=False) - flops.embedding_params(qwen3)
    assert abs(without_head - 29.9e9) < 0.05e9


def _matmul_flops(counter: FlopCounterMode) -> int:
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_forward_and_training_flops_equal_flop_counter(name):
    """Guards forward and training FLOPs of MoE layers (router, k experts per token, shared expert
    and its 1-wide gate, dense layers where is_moe_layer is false) against FlopCounterMode on the
    real model: every token runs exactly k experts, so the matmul FLOPs are exact whatever the
    routing. Attention runs in SDPA, which the counter does not count on CPU."""
    config = MOE_CONFIGS[name]
    model = _model(config)
    batch, seq_len = 2, 9
    token_ids = torch.randint(0, config.vocab_size, (batch, seq_len))  # (batch, seq)
    positions = torch.arange(seq_len).expand(batch, seq_len)  # (batch, seq)
    with FlopCounterMode(display=False) as forward:
        logits = model(token_ids, positions)  # (batch, seq, vocab)
    with FlopCounterMode(display=False) as backward:
        logits.float().square().mean().backward()
    tokens = batch * seq_len
    attention = flops.attention_flops_per_token(config, seq_len) * tokens
    expected = flops.forward_flops_per_token(config, seq_len) * tokens - attention
    print(f"{name}: forward {_matmul_flops(forward)}, backward {_matmul_flops(backward)}, formula {expected}")
    assert _matmul_flops(forward) == expected
    assert _matmul_flops(forward) + _matmul_flops(backward) == (
        flops.train_flops_per_token(config, seq_len) * tokens - 3 * attention)
    every_expert = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert _matmul_flops(forward) < 2 * tokens * every_expert


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(8, 2, 1), (8, 2, 3), (60, 4, 16),
                                                          (128, 8, 32), (128, 8, 64)])
def test_expected_experts_touched_matches_monte_carlo_routing(num_experts, top_k, num_tokens):
    """Guards X (1 - (1 - k/X)^B) against simulated uniform routing through slipstream's own
    `route` (top k of a softmax of i.i.d. logits: a uniformly random k-subset), seeded, within 4
    standard errors of the simulated mean."""
    generator = torch.Generator().manual_seed(0)
    trials = 1000
    logits = torch.randn(trials * num_tokens, num_experts, generator=generator)  # (trials * B, X)
    _, experts = route(logits, top_k, renormalize=False)  # (trials * B, k)
    chosen = experts.reshape(trials, num_tokens * top_k)  # each trial's B tokens' choices
    touched = torch.zeros(trials, num_experts).scatter_(1, chosen, 1.0).sum(dim=1)  # (trials,)
    mean, stderr = touched.mean().item(), touched.std().item() / math.sqrt(trials)
    formula = flops.expected_experts_touched(num_experts, top_k, num_tokens)
    print(f"X={num_experts} k={top_k} B={num_tokens}: simulated {mean:.3f} +- {stderr:.3f}, "
          f"formula {formula:.3f}")
    assert abs(formula - mean) <= 4 * stderr + 1e-9
    if num_tokens == 1:
        assert formula == pytest.approx(top_k)


def test_expected_experts_touched_rejects_bad_input():
    """Guards the ValueErrors naming the bad value."""
    with pytest.raises(ValueError, match="experts_per_token .* got 9"):
        flops.expected_experts_touched(8, 9, 1)
    with pytest.raises(ValueError, match="num_tokens .* got -1"):
        flops.expected_experts_touched(8, 2, -1)
    with pytest.raises(ValueError, match="num_experts .* got 0"):
        flops.expected_experts_touched(0, 1, 1)


def test_decode_bytes_read_the_touched_experts():
    """Guards the bytes of a decode step: at batch 1 every weight but the unread embedding rows and
    the experts past k in each MoE layer (counted from the model's tensors); at a large batch every
    expert; in between the expected number touched."""
    config = MOE_CONFIGS["mixtral"]
    model = _model(config)
    rows = config.hidden_size * 4
    embedding = model.model.embed_tokens.weight.numel()
    batch1 = (_hand_active_params(model, config) - embedding) * 4 + rows
    assert flops.decode_bytes_per_step(config, "float32", 1, 0) == pytest.approx(batch1)
    every = (sum(p.numel() for p in model.parameters()) - embedding) * 4
    assert flops.decode_bytes_per_step(config, "float32", 1000, 0) == pytest.approx(every + 1000 * rows)
    expert = sum(p.numel() for p in _expert_blocks(model)[0].experts[0].parameters()) * 4
    touched = flops.expected_experts_touched(4, 2, 3)
    middle = batch1 + 2 * rows + 2 * (touched - 2) * expert  # 2 MoE layers
    assert flops.decode_bytes_per_step(config, "float32", 3, 0) == pytest.approx(middle)


@pytest.mark.parametrize("num_tokens", [1, 5, 4096])
def test_layer_gemms_of_a_moe_layer(num_tokens):
    """Guards the time model's MoE GEMMs: their FLOPs are exactly k experts per token (the forward
    formula's), their weights those of the experts touched (k at one token)."""
    config = MOE_CONFIGS["qwen2_moe-shared"]
    shape = TransformerShape.from_model_config(config)
    gemms = layer_gemms(shape, num_tokens, 1, moe=True)
    layer_flops = sum(2 * m * k * n * count for m, k, n, count in gemms)
    active = (flops.matmul_params(config) - shape.embedding_params()
              - shape.num_dense_layers * shape.layer_matmul_params()) / len(shape.moe_layers)
    assert layer_flops == pytest.approx(2 * num_tokens * active)
    weights = sum(k * n * count for m, k, n, count in gemms)
    touched = shape.experts_touched(num_tokens)
    assert weights == pytest.approx(active + (touched - config.num_experts_per_tok) * shape.expert_params())
    if num_tokens == 1:
        assert weights == pytest.approx(active)


MIXTRAL_HF = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=32768, torch_dtype="bfloat16")
"""Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), the keys that shape it."""
MIXTRAL = TransformerShape.from_model_config(ModelConfig.from_hf_dict(MIXTRAL_HF), "mixtral-8x7b")


def test_serving_reads_k_experts_at_batch_1_and_all_in_a_large_batch():
    """Guards the serving model's decode bytes: at batch 1 the active weights (KV and activations
    add under 1%), at batch 256 every weight (and 256 tokens' activations, under 10% more); the
    weights held are every expert."""
    setup = ServeSetup(shape=MIXTRAL, tp=2)
    assert setup.weights_bytes_per_device() == MIXTRAL.num_params() * 2 / 2
    one = step_time(setup, H100, decode_contexts=[1])
    active = (MIXTRAL.active_params() - MIXTRAL.embedding_params()) * 2 / 2
    print(f"batch 1 reads {one.memory_bytes / 1e9:.3f} GB, active weights {active / 1e9:.3f} GB")
    assert one.memory_bytes == pytest.approx(active, rel=0.01)
    full = step_time(setup, H100, decode_contexts=[1] * 256)
    every = (MIXTRAL.num_params() - MIXTRAL.embedding_params()) * 2 / 2
    print(f"batch 256 reads {full.memory_bytes / 1e9:.3f} GB, all weights {every / 1e9:.3f} GB")
    assert every < full.memory_bytes < 1.1 * every
    assert full.total_s > 2 * one.total_s


def test_training_mfu_counts_active_flops_and_memory_holds_every_expert():
    """Guards the training model: model FLOPs per step are the active-parameter formula (Megatron's
    and torchtitan's MoE MFU), while weights, gradients and optimizer states hold every expert."""
    setup = TrainSetup(shape=MIXTRAL, global_batch_size=64, seq_len=4096)
    prediction = predict_training(setup, Layout(dp=8, zero_stage=3), H100)
    active = 6 * MIXTRAL.matmul_params() + MIXTRAL.attention_flops_per_token(4096) * 3
    assert prediction.model_flops_per_step == pytest.approx(64 * 4096 * active)
    assert MIXTRAL.matmul_params() < 0.3 * MIXTRAL.num_params()
    memory = training_memory(setup, Layout(dp=8, zero_stage=1))
    assert memory.gradients_bytes == pytest.approx(4 * MIXTRAL.num_params())
    assert memory.weights_bytes == pytest.approx(6 * MIXTRAL.num_params())
    staged = training_memory(setup, Layout(dp=2, pp=4))
    assert staged.weights_bytes == pytest.approx(6 * (8 * MIXTRAL.layer_params(moe=True)
                                                      + MIXTRAL.embedding_params()))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_activation_memory_equals_what_the_moe_model_saves(model_type):
    """Guards the activation bytes of MoE layers (the k experts' SwiGLU, routing's indices, weights
    and rows, the shared expert) against what autograd saves for slipstream's model under the
    trainer's recipe, fp32 and bf16 autocast, with a dense layer among the routed ones (qwen2_moe):
    within 1%, as for dense models."""
    experts = (dict(num_experts=4, num_experts_per_tok=2) if model_type == "mixtral" else
               dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=160,
                    shared_expert_intermediate_size=384, mlp_only_layers=(1,)))
    config = ModelConfig(model_type=model_type, vocab_size=1024, hidden_size=256, intermediate_size=320,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, **experts)
    _check_activation_memory(config)


def _check_activation_memory(config) -> None:
    """The priced activation bytes of `config`'s whole model equal what autograd saves under the
    trainer's recipe (3 sequences of 80 tokens), fp32 and bf16 autocast, within 1%."""
    shape = TransformerShape.from_model_config(config)
    batch, seq_len = 3, 80
    for dtype in ("fp32", "bf16"):
        measured = _trainer_saved_activation_bytes(config, dtype, batch, seq_len)
        setup = TrainSetup(shape=shape, global_batch_size=batch, micro_batch_size=batch, seq_len=seq_len,
                           dtype=dtype)
        model = training_memory(setup, Layout()).activations_bytes
        print(config.model_type, f"top {config.num_experts_per_tok}", dtype, "autograd saves", measured,
              "model", model)
        assert model == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("top_k", [1, 2])
def test_gpt_oss_activation_memory_equals_what_its_moe_model_saves(top_k):
    """Guards the activation bytes of gpt-oss's MoE block (top k of the biased router's raw logits,
    softmax over the k, the experts' biased gate-up, clamps, sigmoid, (up + 1) product and biased
    down projection, in fp32 where autocast's matmul output meets the fp32 bias) against what
    autograd saves for slipstream's whole gpt-oss under the trainer's recipe, fp32 and bf16
    autocast, within 1% as for the other families (autocast's 16-bit copies of each called
    expert's weight slices are weights, which the model counts with the weights, and the measure
    leaves out). The block was priced as Mixtral's: 0.70x in fp32 at
    top 1, 0.63x at top 2; the fp32 normalised copy each of gpt-oss's fp32-weight norms keeps (2 per
    layer and the final one) was not priced (`TransformerShape.fp32_weight_norms`)."""
    _check_activation_memory(_gpt_oss_config(32).replace(num_experts_per_tok=top_k))


def _expert_passes(experts, x, dtype, autocast: bool) -> tuple[NonMatmulPasses, NonMatmulPasses]:
    """What torch's dispatcher sees each expert of `experts()` (one forward's) do on its half of
    x's rows, forward and backward."""
    forward, backward = NonMatmulPasses(expanded_as_storage=True), NonMatmulPasses(expanded_as_storage=True)
    with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = [expert(half) for expert, half in zip(experts(), x.chunk(2), strict=True)]
    grads = [torch.randn_like(out) for out in outs]
    with backward:
        torch.autograd.backward(outs, grads)
    return forward, backward


@pytest.mark.parametrize("num_experts", [2, 3])
@pytest.mark.parametrize("recipe", ["fp32", "autocast", "bf16"])
def test_gpt_oss_expert_passes_match_the_dispatcher(recipe, num_experts):
    """Guards the eager pointwise work of gpt-oss's experts (bias adds, clamps, sigmoid, (up + 1)
    product, their gradients, autocast's casts, the backward of the stacked weights' one unbind:
    a stack of all X experts' gradients, an uncalled expert's a filled zero) against torch's
    dispatcher: what two of X `GptOssExperts` experts do on 256 rows each beyond what two SwiGLU
    experts (`MLP`) do, as the model prices a MoE layer of X experts, 2 of them touched, top 1 and
    512 tokens beyond the same shape without gpt-oss's experts, forward and backward, in fp32, bf16
    autocast on fp32 weights (the trainer) and bf16 parameters: bytes within 2% (per-column bias
    reads), kernels exactly. They were priced as SwiGLU's (about a quarter of the forward bytes),
    then with a select_backward of all X experts' gradient per expert called and their sums
    (GptOssExperts indexed the stacked weights per expert: 1.33x these backward bytes at X = 2)."""
    config = ModelConfig(model_type="gpt_oss", vocab_size=64, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=num_experts, num_experts_per_tok=1, max_position_embeddings=64)
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    torch.manual_seed(0)
    stacked = GptOssExperts(config).to(dtype)
    stacked.reset_parameters(0.02, 0.02, None)
    def gpt_oss():  # as GptOssMoeBlock calls them
        weights_of = stacked.expert_weights()
        return [functools.partial(stacked.expert, weights_of(e)) for e in range(2)]

    mlps = [MLP(config, config.moe_intermediate_size).to(dtype) for _ in range(2)]
    x = torch.randn(512, 256, dtype=torch.bfloat16 if recipe == "autocast" else dtype,  # the block's
                    requires_grad=True)  # input, cast once under autocast
    seen = [(a.bytes - b.bytes, a.kernels - b.kernels) for a, b in zip(
        _expert_passes(gpt_oss, x, dtype, recipe == "autocast"),
        _expert_passes(lambda: mlps, x, dtype, recipe == "autocast"), strict=True)]

    shape = TransformerShape.from_model_config(config)
    e = 4 if recipe == "fp32" else 2
    device = Device(accelerator=H100, efficiency=Efficiency(), element_bytes=e)
    weights = dict(residual_bytes=4, autocast_weights=True) if recipe == "autocast" else {}
    specs = [LayerSpec(shape=s, num_tokens=512, moe=True, pointwise="eager", **weights)
             for s in (shape, dataclasses.replace(shape, expert_bias_params=0))]
    touched = mock.patch.object(TransformerShape, "experts_touched", return_value=2)  # those called
    for passes, (num_bytes, kernels) in zip((pointwise_forward, pointwise_backward), seen, strict=True):
        with touched:
            priced = [passes(spec, device) for spec in specs]
        more_bytes = priced[0].memory_bytes - priced[1].memory_bytes
        more_kernels = (priced[0].overhead_s - priced[1].overhead_s) / device.efficiency.kernel_overhead_s
        print(recipe, passes.__name__, "dispatcher", num_bytes, kernels, "priced", more_bytes, more_kernels)
        assert more_bytes == pytest.approx(num_bytes, rel=0.02)
        assert more_kernels == pytest.approx(kernels)


def test_pipeline_stages_of_mixed_layers_are_refused():
    """Guards the refusal to price pipeline stages of a model that mixes dense and MoE layers (the
    stage split does not say which layers a stage holds), naming pp; pp=1 is priced."""
    shape = TransformerShape.from_model_config(MOE_CONFIGS["qwen3_moe-sparse-step"])
    setup = TrainSetup(shape=shape, global_batch_size=8, seq_len=64)
    with pytest.raises(ValueError, match="pp=2: .* mixes 2 dense and 2 mixture-of-experts layers"):
        predict_training(setup, Layout(pp=2), H100)
    assert predict_training(setup, Layout(dp=2), H100).step_time_s > 0


def test_shape_rejects_inconsistent_experts():
    """Guards TransformerShape's checks of the expert fields, each naming the value."""
    base = TransformerShape.from_model_config(MOE_CONFIGS["mixtral"])
    with pytest.raises(ValueError, match="experts_per_token from 1 to num_experts"):
        dataclasses.replace(base, experts_per_token=5)
    with pytest.raises(ValueError, match="moe_layers must be .* got \\(0, 7\\)"):
        dataclasses.replace(base, moe_layers=(0, 7))
    with pytest.raises(ValueError, match="without experts"):
        dataclasses.replace(base, num_experts=0)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        ServeSetup(shape=MIXTRAL, tp=3)


def test_perf_serve_command_prices_a_moe_config_json(tmp_path, capsys):
    """Guards `slipstream perf serve` on a Mixtral config.json as a user runs it: decode at batch 1
    reads the active weights per device and its KV cache, at batch 64 every expert's and 64 caches
    (and activations, under 5% more); `perf train --pp 2` on a model that mixes dense and MoE
    layers exits 2 naming pp."""
    from slipstream.cli import main

    config = ModelConfig.from_hf_dict(MIXTRAL_HF)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert main(["perf", "serve", "--model", str(tmp_path), "--hardware", "h100", "--tp", "2",
                 "--batch", "1,64", "--context", "1024", "--json"]) in (0, None)
    one, many = (row["work"]["memory_bytes"] for row in json.loads(capsys.readouterr().out)["decode"])
    shape = TransformerShape.from_model_config(config)
    kv = 1025 * shape.kv_bytes_per_token(2) / 2  # the context and the new token, half the heads
    active = (shape.active_params() - shape.embedding_params()) * 2 / 2 + kv
    every = (shape.num_params() - shape.embedding_params()) * 2 / 2 + 64 * kv
    print(f"batch 1 reads {one / 1e9:.2f} GB (active weights and KV {active / 1e9:.2f}), "
          f"batch 64 {many / 1e9:.2f} (all {every / 1e9:.2f})")
    assert one == pytest.approx(active, rel=0.01)
    assert every < many < 1.05 * every
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps(MOE_CONFIGS["qwen3_moe-sparse-step"].to_hf_dict()))
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["perf", "train", "--model", str(mixed), "--hardware", "h100",
                               "--devices", "2", "--pp", "2", "--global-batch", "8", "--seq-len", "64"]))
    assert exit_info.value.code == 2
    assert "pp=2: mixed mixes 2 dense and 2 mixture-of-experts layers" in capsys.readouterr().err


def test_moe_decode_is_priced_eager_as_the_engine_runs_it():
    """Guards the decode of a MoE model against graph replay: the engine runs it eagerly (routing
    reads expert counts on the host, which no graph holds), so a graph budget changes nothing for
    it, while it removes a dense model's launch overheads."""
    contexts = [512] * 8
    eager, graphed = (step_time(ServeSetup(shape=MIXTRAL, tp=2, decode_graph_max_batch=graphs), H100,
                                decode_contexts=contexts) for graphs in (0, 256))
    assert graphed.total_s == eager.total_s
    dense = dataclasses.replace(MIXTRAL, num_experts=0, experts_per_token=0, expert_ffn_hidden_size=0,
                                moe_layers=())
    eager, graphed = (step_time(ServeSetup(shape=dense, tp=2, decode_graph_max_batch=graphs), H100,
                                decode_contexts=contexts) for graphs in (0, 256))
    assert graphed.total_s < eager.total_s


def test_sequence_parallelism_leaves_the_routing_whole():
    """Guards the MoE activations under sequence parallelism: SP splits what is replicated across
    tensor-parallel ranks (the norm and projection inputs), not the routing, whose rows are
    gathered whole on every rank; so SP saves a MoE layer exactly what it saves a dense layer of
    the same attention and hidden size."""
    dense = dataclasses.replace(MIXTRAL, num_experts=0, experts_per_token=0, expert_ffn_hidden_size=0,
                                moe_layers=())
    saved = {}
    for name, shape in (("moe", MIXTRAL), ("dense", dense)):
        setup = TrainSetup(shape=shape, global_batch_size=8, micro_batch_size=1, seq_len=4096, dtype="bf16")
        saved[name] = (activation_bytes_per_layer(setup, 8, False, 4096)
                       - activation_bytes_per_layer(setup, 8, True, 4096))
    assert saved["moe"] == pytest.approx(saved["dense"])


def test_fp32_weight_norms_follow_the_family():
    """Guards `TransformerShape.fp32_weight_norms` against the norms slipstream's model builds
    (`FP32WeightRMSNorm` for gpt-oss and OLMo 2, not Llama's), and its refusal on a norm other than
    an RMSNorm, naming the norm."""
    from slipstream.model.transformer import FP32WeightRMSNorm, make_norm

    for model_type in ("gpt_oss", "olmo2", "llama"):
        experts = dict(num_experts=4, num_experts_per_tok=2) if model_type == "gpt_oss" else {}
        config = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **experts)
        shape = TransformerShape.from_model_config(config)
        assert shape.fp32_weight_norms == isinstance(make_norm(config, 8), FP32WeightRMSNorm)
        assert shape.fp32_weight_norms == (model_type != "llama")
    with pytest.raises(ValueError, match="fp32_weight_norms=True .* got norm='layernorm'"):
        dataclasses.replace(shape, fp32_weight_norms=True, norm="layernorm")
