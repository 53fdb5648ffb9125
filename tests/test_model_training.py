"""The decoder's backward: gradients against transformers', and what it saves for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.model import ModelConfig, Transformer, load_model
from slipstream.model.transformer import RMSNorm
from slipstream.model.weights import model_tensors
from slipstream.ops.attention import dense_causal_attention

GRAD_RTOL_FP32 = 1e-4


def _loss(model, ids: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of either model, logits in fp32."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if isinstance(model, Transformer):
            logits = model(ids[:, :-1], torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1))
        else:
            logits = model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def _grads(model, ids: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    model.zero_grad()
    _loss(model, ids, autocast).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _hf_grads_by_our_names(
    ours: Transformer, hf, ids: torch.Tensor, autocast: bool
) -> dict[str, torch.Tensor]:
    """transformers' gradients under our parameter names (Phi-3's fused q/k/v and gate/up split as
    the loader splits the weights)."""
    return dict(pair for name, grad in _grads(hf, ids, autocast).items()
                for pair in model_tensors(ours.config, name, grad))


def test_gradients_equal_transformers(family, make_hf_model, tmp_path):
    """Every parameter's fp32 gradient equals LlamaForCausalLM's (and the other families') on the
    same weights and batch, to a relative L2 error of 1e-4: the hand-written RMSNorm backward,
    grouped-query SDPA and the sliding window (mistral's 7 is shorter than the 19 tokens) all
    differentiate as HF's eager attention does. Under bf16 autocast the whole gradient is as far
    from the fp32 one as transformers' own bf16 gradient is, within 25%."""
    hf = make_hf_model(family).train()
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).train()
    ids = torch.randint(0, hf.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    expected, got = _hf_grads_by_our_names(ours, hf, ids, False), _grads(ours, ids, False)
    assert set(got) == set(expected)
    errors = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in expected.items()}
    worst = max(errors, key=errors.get)
    print(f"{family} fp32: worst relative gradient error {errors[worst]:.2e} ({worst})")
    assert errors[worst] < GRAD_RTOL_FP32

    def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([grads[n].flatten() for n in sorted(grads)])

    exact = flat(expected)
    hf_bf16, ours_bf16 = flat(_hf_grads_by_our_names(ours, hf, ids, True)), flat(_grads(ours, ids, True))
    hf_error = ((hf_bf16 - exact).norm() / exact.norm()).item()
    our_error = ((ours_bf16 - exact).norm() / exact.norm()).item()
    print(f"{family} bf16 autocast: gradient error {our_error:.2e} (transformers {hf_error:.2e})")
    assert our_error < 1.25 * hf_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_equals_autograd_of_the_reference(dtype):
    """RMSNorm's hand-written backward equals autograd through transformers' LlamaRMSNorm, for
    (tokens, hidden) and per-head (B, T, heads, D) inputs."""
    transformers = pytest.importorskip("transformers")
    for shape in [(37, 48), (2, 5, 3, 48)]:
        torch.manual_seed(0)
        x = (3 * torch.randn(shape)).to(dtype)
        weight = torch.randn(48).to(dtype)
        grad_out = torch.randn(shape).to(dtype)
        reference = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-6).to(dtype)
        ours = RMSNorm(48, 1e-6).to(dtype)
        results = []
        for norm in (reference, ours):
            with torch.no_grad():
                norm.weight.copy_(weight)
            leaf = x.clone().requires_grad_()
            out = norm(leaf)
            out.backward(grad_out)
            results.append((out, leaf.grad, norm.weight.grad))
        for name, want, have in zip(("output", "grad x", "grad weight"), *results, strict=True):
            err = ((have.float() - want.float()).norm() / want.float().norm()).item()
            print(dtype, shape, name, f"relative error {err:.2e}")
            assert err < (1e-6 if dtype == torch.float32 else 1e-2), name


def _saved_storages(fn) -> dict[int, torch.Tensor]:
    """The distinct storages autograd saves while `fn()` runs, each with one tensor viewing it."""
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_rms_norm_saves_its_input_and_one_scale_per_row():
    """Only x, the weight and the (rows, 1) fp32 reciprocal RMS, not a normalised fp32 copy."""
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(10, 64, requires_grad=True)
    saved = _saved_storages(lambda: norm(x))
    assert sorted(t.numel() for t in saved.values()) == [10, 64, 640]


def test_grouped_query_attention_saves_unexpanded_keys_and_values():
    """With 6 query heads over 2 key/value heads, the backward holds K and V at 2 heads (with
    and without a sliding-window mask) and the output equals attention over expanded heads."""
    torch.manual_seed(0)
    B, T, H, K, D = 2, 33, 6, 2, 16
    q = torch.randn(B, T, H, D, requires_grad=True)
    k, v = (torch.randn(B, T, K, D, requires_grad=True) for _ in range(2))
    for window in (None, 8):
        out: list[torch.Tensor] = []
        saved = _saved_storages(
            lambda out=out, w=window: out.append(dense_causal_attention(q, k, v, sliding_window=w)))
        assert max(t.untyped_storage().nbytes() for t in saved.values()) == B * T * H * D * 4
        assert sum(t.untyped_storage().nbytes() == B * T * H * D * 4 for t in saved.values()) == 2  # q, out
        expanded = [x.repeat_interleave(H // K, dim=2).transpose(1, 2) for x in (k, v)]
        scores = q.transpose(1, 2) @ expanded[0].transpose(-1, -2) / D**0.5  # (B, H, T, T)
        pos = torch.arange(T)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        reference = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ expanded[1]).transpose(1, 2)
        torch.testing.assert_close(out[0], reference, atol=1e-5, rtol=1e-5)


def test_autocast_projections_share_one_saved_input():
    """Under bf16 autocast q, k and v (and gate and up) read one bf16 copy of their normalised
    input: a decoder layer saves two (tokens, hidden) bf16 tensors, not five (head dim 12, so no
    attention tensor has the hidden size's bytes)."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    model = Transformer(config)
    ids = torch.randint(0, 64, (2, 9))
    positions = torch.arange(9).expand(2, 9)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cos_sin = model.model.rope(positions, torch.float32)
            model.model.layers[0](model.model.embed_tokens(ids), *cos_sin, None)

    saved = _saved_storages(forward)
    hidden_bf16 = [t for t in saved.values()
                   if t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() == 2 * 9 * 32 * 2]
    assert len(hidden_bf16) == 2


def test_swiglu_saves_gate_and_up_only():
    """The MLP's backward holds its input, gate, up and the product (the down projection's
    input), not silu(gate) too: four (tokens, ...) tensors besides the weights."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    mlp = Transformer(config).model.layers[0].mlp
    x = torch.randn(2, 9, 32, requires_grad=True)
    saved = _saved_storages(lambda: mlp(x))
    numels = sorted(t.untyped_storage().nbytes() // 4 for t in saved.values())
    assert numels == [2 * 9 * 32] + [2 * 9 * 40] * 3 + [32 * 40] * 3  # then the three weights


def test_a_sliding_window_mask_made_for_inference_serves_training():
    """The sliding-window mask every layer shares is kept for the next forward; one first made
    under inference mode is still an ordinary tensor, so a training forward can save it for its
    backward (an inference tensor there is a RuntimeError)."""
    q, k, v = (torch.randn(1, 10, 2, 8) for _ in range(3))
    with torch.inference_mode():
        dense_causal_attention(q, k, v, sliding_window=3)
    q = q.clone().requires_grad_()
    dense_causal_attention(q, k, v, sliding_window=3).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
