"""The CPU inference fast path computes what the model's plain modules compute."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from slipstream.model import ModelConfig, Transformer
from slipstream.model.transformer import MLP, Attention, RMSNorm, Rotary, SiluAndMul
from slipstream.ops import cpu_kernels
from slipstream.ops.inference import (
    KernelDecoder,
    KernelRMSNorm,
    KernelRotary,
    KernelSiluAndMul,
    fuse_projections,
    optimize_for_cpu_inference,
)

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_module(dtype):
    """The fused RMSNorm equals RMSNorm (bitwise in bf16, where both round twice; 1e-6 in fp32)."""
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data.normal_()
    x = (3 * torch.randn(5, 7, 96)).to(dtype)
    expected, got = norm(x), KernelRMSNorm(norm)(x)
    diff = (expected.float() - got.float()).abs().max().item()
    print(f"{dtype}: max diff {diff:.3g}")
    assert diff <= (0 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 96), (5, 7, 96), (300, 77)])
def test_add_rms_norm_kernel_matches_its_two_steps(dtype, shape):
    """The fused residual sum and RMSNorm equal PyTorch's `residual + x` followed by the RMSNorm
    kernel, bit for bit: the residual updated in place, the normed rows returned (rows past
    MIN_PARALLEL_ROWS on both threads, a row length not a multiple of 16)."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data.normal_()
    residual, x = (3 * torch.randn(shape)).to(dtype), (3 * torch.randn(shape)).to(dtype)
    expected_sum = residual + x
    expected = KernelRMSNorm(norm)(expected_sum)
    got = cpu_kernels.add_rms_norm_(residual, x, norm.weight, norm.eps)
    assert torch.equal(residual, expected_sum)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_decoder_matches_its_layers(dtype):
    """optimize_for_cpu_inference's decoder, each residual sum fused into the next RMSNorm, gives
    bit for bit the final hidden states of the same kernel modules run layer by layer."""
    from slipstream.model.transformer import rope_cos_sin

    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights(std=0.1)
    fast = optimize_for_cpu_inference(model.to(dtype).eval())
    decoder = fast.model
    assert isinstance(decoder, KernelDecoder)
    ids = torch.randint(0, 300, (2, 11))
    positions = torch.arange(11).expand(2, 11)
    with torch.inference_mode():
        got = fast.hidden_states(ids, positions)
        x = decoder.embed_tokens(ids)
        cos, sin = rope_cos_sin(decoder.rope.inv_freq, positions, x.dtype)
        for layer in decoder.layers:
            x = layer(x, cos, sin, None)
        expected = decoder.norm(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_matches_module(dtype):
    """The in-place rotary kernel equals apply_rope on queries and keys (GQA shapes)."""
    from slipstream.model.transformer import rope_cos_sin, rope_inv_freq

    config = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    positions = torch.tensor([[0, 1, 7, 300, 4095]])
    cos, sin = rope_cos_sin(rope_inv_freq(config), positions, dtype)
    q = torch.randn(1, 5, 4, 32).to(dtype)
    k = torch.randn(1, 5, 2, 32).to(dtype)
    expected = Rotary()(q, k, cos, sin)
    got = KernelRotary()(q.clone(), k.clone(), cos, sin)
    diffs = [(e.float() - g.float()).abs().max().item() for e, g in zip(expected, got, strict=True)]
    print(f"{dtype}: max diff q {diffs[0]:.3g}, k {diffs[1]:.3g}")
    assert max(diffs) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_rotates_strided_rows_in_place(dtype):
    """Queries and keys as the fused q/k/v product's splits leave them are rotated where they lie
    (the values beside them untouched), as their contiguous copies are; an expanded tensor, whose
    rows share memory, is rotated into a copy instead."""
    from slipstream.model.transformer import rope_cos_sin, rope_inv_freq

    config = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    positions = torch.tensor([[0, 1, 7, 300, 4095]])
    cos, sin = rope_cos_sin(rope_inv_freq(config), positions, dtype)
    qkv = torch.randn(1, 5, 256, dtype=dtype)
    before = qkv.clone()
    q, k, v = (x.view(1, 5, -1, 32) for x in qkv.split([128, 64, 64], dim=-1))
    expected = KernelRotary()(q.contiguous(), k.contiguous(), cos, sin)
    got = KernelRotary()(q, k, cos, sin)
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(qkv[..., 192:], before[..., 192:])
    row = torch.randn(1, 1, 2, 32, dtype=dtype)
    expanded = row.expand(1, 5, 2, 32)
    rotated = cpu_kernels.rotary_embedding_(expanded, cos, sin)
    assert torch.equal(rotated, cpu_kernels.rotary_embedding_(expanded.contiguous(), cos, sin))
    assert torch.equal(expanded[0, 0], row[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_kernel_matches_module(dtype):
    """The fused kernel equals F.silu(gate) * up, over a range that reaches exp's overflow on both
    sides: within 1e-5 in fp32, and in bf16 (where both round twice) within one bf16 step, since
    the last bit of exp can differ from PyTorch's."""
    torch.manual_seed(0)
    x = (20 * torch.randn(3, 5, 2 * 77)).to(dtype)
    x[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    expected, got = SiluAndMul()(x), KernelSiluAndMul()(x)
    diff = ((expected.float() - got.float()).abs() / expected.float().abs().clamp(min=1e-6)).max().item()
    print(f"{dtype}: max relative diff {diff:.3g}")
    assert got.shape == (3, 5, 77) and got.dtype == dtype
    assert diff <= (2**-7 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (5, 16), (17, 33), (64, 32000), (2, 151936)])
def test_argmax_kernel_matches_torch(dtype, shape):
    """Row argmax equals torch.argmax, ties and NaNs included: the first of equal largest values
    (-0.0 equal to 0.0), the first NaN of a row that has one, index 0 of a row of -inf."""
    torch.manual_seed(0)
    x = torch.randn(*shape).to(dtype)
    rows, width = shape
    special = [  # (row, columns, value)
        (1, [width // 2, width - 1], float("nan")), (1, [0], float("inf")),
        (2, slice(None), float("-inf")),
        (3, [width - 1, width // 3], 1e4),
        (4, slice(None), 0.0), (4, [width - 1], -0.0),
        (5, [width - 1], float("inf")), (5, [width // 2], float("nan")),
    ]
    for row, columns, value in special:
        if row < rows:
            x[row, columns] = value
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(-1))
    assert torch.equal(cpu_kernels.argmax(x.T.contiguous().T), x.argmax(-1))  # strided rows copied


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_match_separate_ones(bias):
    """fuse_projections replaces q/k/v and gate/up with one linear each and keeps the logits."""
    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=bias,
                         mlp_bias=bias)
    torch.manual_seed(0)
    plain = Transformer(config)
    plain.init_weights(std=0.2)
    if bias:
        for name, param in plain.named_parameters():
            if name.endswith("bias"):
                param.data.normal_()
    fused = fuse_projections(copy.deepcopy(plain))
    for module in fused.modules():
        if isinstance(module, Attention):
            assert module.qkv_proj.out_features == (4 + 2 + 2) * 16 and not hasattr(module, "q_proj")
        if isinstance(module, MLP):
            assert module.gate_up_proj.out_features == 2 * 48 and not hasattr(module, "up_proj")
    ids = torch.randint(0, 50, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    with torch.inference_mode():
        diff = (plain(ids, positions) - fused(ids, positions)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimized_model_matches_plain_model(dtype):
    """A whole model after optimize_for_cpu_inference gives the plain model's logits."""
    config = ModelConfig(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    plain = Transformer(config)
    plain.init_weights(std=0.1)
    plain = plain.to(dtype).eval()
    fast = optimize_for_cpu_inference(copy.deepcopy(plain))
    assert any(isinstance(m, KernelRMSNorm) for m in fast.modules())
    assert any(isinstance(m, KernelSiluAndMul) for m in fast.modules())
    ids = torch.randint(0, 300, (2, 11))
    positions = torch.arange(11).expand(2, 11)
    with torch.inference_mode():
        expected, got = plain(ids, positions).float(), fast(ids, positions).float()
    diff = (expected - got).abs().max().item()
    print(f"{dtype}: max |logit diff| {diff:.3g} (logit scale {expected.abs().max().item():.3g})")
    assert diff < (5e-2 * expected.abs().max().item() if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("extra_copies", [False, True])
def test_packed_linear_matches_linear(dtype, num_rows, bias, extra_copies):
    """PackedLinear equals nn.Linear through each of its paths: the C matrix-vector kernel (below
    `cpu_kernels.min_panel_rows` rows, or up to four where the CPU has no panel kernel; odd sizes
    with tails), the panel kernel (fp32, and bf16 up to MAX_PANEL_ROWS rows or all where it
    multiplies in fp32) and oneDNN (without the extra copies, and bf16 past MAX_PANEL_ROWS rows
    where the CPU multiplies bf16 natively). Where oneDNN cannot multiply the dtype (bf16 on an
    AVX2 CPU) the panel copy is kept even without the extra copies; where the panel copy takes
    every size (fp32 with AVX-512), no oneDNN copy is made."""
    from slipstream.ops.linear import PackedLinear, onednn_multiplies

    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 257, bias=bias).to(dtype)
    packed = PackedLinear(linear, extra_copies=extra_copies)
    has_panels = cpu_kernels.supports_panel_gemm(linear.weight) and (
        extra_copies or not onednn_multiplies(dtype))
    assert (packed.panel_weight is not None) == has_panels
    panels_take_all = has_panels and cpu_kernels.panel_gemm_takes_all_rows(dtype)
    assert (packed.packed_weight is not None) == (onednn_multiplies(dtype) and not panels_take_all)
    x = torch.randn(1, num_rows, 100).to(dtype)
    with torch.inference_mode():
        expected, got = linear(x).float(), packed(x).float()
    diff = (expected - got).abs().max().item() / expected.abs().max().item()
    print(f"{dtype} rows {num_rows} bias {bias}: max relative diff {diff:.3g}")
    assert diff < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("panels", [False, True])
def test_packed_linear_without_onednn_matches_linear(monkeypatch, dtype, panels):
    """Where oneDNN cannot multiply the dtype (its bf16 needs AVX-512 or AVX-NE-CONVERT, so an
    AVX2 CPU has none), PackedLinear keeps no oneDNN copy and still equals nn.Linear at every
    size: through the panel copy as its only one, or, where the CPU has no panel kernel either,
    through PyTorch's own product."""
    from slipstream.ops import linear as linear_module

    monkeypatch.setattr(linear_module, "onednn_multiplies", lambda dtype: False)
    if not panels:
        monkeypatch.setattr(cpu_kernels, "supports_panel_gemm", lambda weight: False)
    elif not cpu_kernels.supports_panel_gemm(torch.empty(1, dtype=dtype)):
        pytest.skip(f"no {dtype} panel kernel on this CPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 257, bias=True).to(dtype)
    for extra_copies in (False, True):
        packed = linear_module.PackedLinear(linear, extra_copies=extra_copies)
        assert packed.packed_weight is None and (packed.panel_weight is not None) == panels
        for num_rows in (1, 3, 5, 70, 300):
            x = torch.randn(num_rows, 100).to(dtype)
            with torch.inference_mode():
                expected, got = linear(x).float(), packed(x).float()
            diff = (expected - got).abs().max().item() / expected.abs().max().item()
            assert diff < (1e-2 if dtype == torch.bfloat16 else 1e-5), (extra_copies, num_rows, diff)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4])
def test_matrix_vector_kernel_matches_linear(dtype, num_rows):
    """The C matrix-vector kernel (batch-1 decode; up to four rows where the CPU has no panel
    kernel) equals nn.Linear for input widths that end in a full vector pair, a single vector and
    a scalar tail."""
    torch.manual_seed(num_rows)
    for in_features in (64, 80, 116):
        linear = torch.nn.Linear(in_features, 257, bias=True).to(dtype)
        x = torch.randn(num_rows, in_features).to(dtype)
        with torch.inference_mode():
            expected = linear(x).float()
            got = cpu_kernels.gemv(x, linear.weight.contiguous(), linear.bias).float()
        diff = (expected - got).abs().max().item() / expected.abs().max().item()
        assert diff < (1e-2 if dtype == torch.bfloat16 else 1e-5), (in_features, diff)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 9, 64, 131, 1030])
def test_panel_gemm_matches_float64_reference(dtype, num_rows):
    """The panel kernel against a float64 product: output widths with partial panels (5, 50,
    100) and exact ones (48, 96), reductions shorter than a vector, odd (a bf16 pair without its
    partner), and longer than one fp32 k-chunk (1101 > 512), multiples of 32 (AMX tiles where
    the CPU has them) and not (the vector kernels there), with and without bias; with at most
    as many panels as threads the rows are split as well; from 1024 rows they go in bands. Its
    error stays within a few times that of PyTorch's own product in the same dtype (fp32: a
    different summation order; bf16: both round the fp32 sum once)."""
    if not cpu_kernels.supports_panel_gemm(torch.empty(1, dtype=dtype)):
        pytest.skip(f"no {dtype} panel kernel on this CPU")
    torch.manual_seed(num_rows)
    for out_features, in_features in [(5, 7), (48, 16), (50, 33), (96, 512), (100, 1101), (70, 96)]:
        weight = torch.randn(out_features, in_features).to(dtype)
        bias = torch.randn(out_features).to(dtype)
        x = torch.randn(num_rows, in_features).to(dtype)
        panels = cpu_kernels.pack_panels(weight)
        for b in (None, bias):
            got = cpu_kernels.panel_gemm(x, panels, b, out_features)
            exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
            torch_error = (torch.nn.functional.linear(x, weight, b).double() - exact).abs().max().item()
            error = (got.double() - exact).abs().max().item()
            assert got.shape == (num_rows, out_features) and got.dtype == dtype
            assert error <= 8 * torch_error + 1e-6, (out_features, in_features, error, torch_error)


def test_panel_gemm_uses_amx_only_where_the_cpu_has_it():
    """The tiles are used only where the kernel reports the AMX-BF16 flag (and then bf16 takes
    the panel kernel from one row: it streams the weight faster than the matrix-vector kernel)."""
    if cpu_kernels.library() is None:
        pytest.skip("no C kernels here")
    if cpu_kernels.panel_gemm_uses_amx():
        assert " amx_bf16" in Path("/proc/cpuinfo").read_text()
        assert cpu_kernels.min_panel_rows(torch.bfloat16) == 1


def test_weight_copies_share_one_huge_page_buffer_per_layout():
    """pack_linears(extra_copies=True) copies every weight into slices of one 2 MiB-aligned buffer
    (small weights do not each take a huge page), holding exactly the original weights, and its
    panel-packed copies into slices of another, each what pack_panels makes of the weight alone."""
    from slipstream.ops.allocator import HUGE_PAGE_BYTES
    from slipstream.ops.linear import PackedLinear, pack_linears

    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = Transformer(config)
    plain.init_weights(std=0.1)
    weights = {name: m.weight.detach().clone() for name, m in plain.named_modules()
               if isinstance(m, torch.nn.Linear)}
    packed = pack_linears(copy.deepcopy(plain), extra_copies=True)
    rows = {name: m.row_weight for name, m in packed.named_modules() if isinstance(m, PackedLinear)}
    assert rows.keys() == weights.keys()
    assert all(torch.equal(rows[name], weights[name]) for name in weights)
    assert len({r.untyped_storage().data_ptr() for r in rows.values()}) == 1
    assert min(r.data_ptr() for r in rows.values()) % HUGE_PAGE_BYTES == 0
    if not cpu_kernels.supports_panel_gemm(next(iter(weights.values()))):
        return
    panels = {name: m.panel_weight for name, m in packed.named_modules() if isinstance(m, PackedLinear)}
    assert all(torch.equal(panels[name], cpu_kernels.pack_panels(weights[name])) for name in weights)
    assert len({p.untyped_storage().data_ptr() for p in panels.values()}) == 1
    assert min(p.data_ptr() for p in panels.values()) % HUGE_PAGE_BYTES == 0


def test_fusing_and_packing_free_each_original_weight_as_they_go(monkeypatch):
    """optimize_for_cpu_inference holds no original linear weight past its own fusing or packing,
    so that the copies after it can reuse its memory: when a linear is packed, every linear packed
    before it is gone, and so is every q/k/v and gate/up weight fused before the current one."""
    import weakref

    from slipstream.ops import inference as inference_module
    from slipstream.ops import linear as linear_module

    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights(std=0.1)
    fused_before, alive_at_fusing = [], []
    real_concatenated = inference_module._concatenated

    def recording_concatenated(*linears):
        alive_at_fusing.append(sum(ref() is not None for ref in fused_before))
        fused_before.extend(weakref.ref(m.weight) for m in linears)
        return real_concatenated(*linears)

    packed_before, alive_at_packing = [], []
    real_init = linear_module.PackedLinear.__init__

    def recording_init(self, linear, **kwargs):
        alive_at_packing.append(sum(ref() is not None for ref in packed_before))
        packed_before.append(weakref.ref(linear.weight))
        real_init(self, linear, **kwargs)

    monkeypatch.setattr(inference_module, "_concatenated", recording_concatenated)
    monkeypatch.setattr(linear_module.PackedLinear, "__init__", recording_init)
    optimize_for_cpu_inference(model)
    assert alive_at_fusing == [0] * 2 * 3  # q/k/v and gate/up per layer
    assert alive_at_packing == [0] * (4 * 3 + 1)  # qkv, o, gate_up, down per layer and the lm_head


def test_pack_panels_into_a_buffer_checks_its_size_and_dtype():
    weight = torch.randn(20, 12)
    if not cpu_kernels.supports_panel_gemm(weight):
        pytest.skip("no panel kernel here")
    numel = cpu_kernels.panel_numel(20, 12, torch.float32)
    into = torch.full((numel,), float("nan"))
    assert cpu_kernels.pack_panels(weight, out=into) is into
    assert torch.equal(into, cpu_kernels.pack_panels(weight))
    strided = torch.empty(2 * numel)[::2]
    for bad in (torch.empty(numel - 1), torch.empty(numel, dtype=torch.bfloat16), strided):
        with pytest.raises(ValueError, match="out must be"):
            cpu_kernels.pack_panels(weight, out=bad)
