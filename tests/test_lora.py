"""LoRA adapters (serve.lora): requests and PEFT adapters checked as vLLM and PEFT check them, the
wrapped linears' updates against x @ (W + s B A)^T in float64, and whole models with several
adapters and base rows in one batch against transformers running each adapter merged into its
weights (lora_fixtures.merge_adapter)."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from lora_fixtures import ALL_PROJECTIONS, merge_adapter, save_random_adapter
from safetensors.torch import load_file, save_file
from serve_fixtures import positioned_logits, random_hf, save_with_tokenizer

from slipstream.model import ModelConfig, load_model
from slipstream.model.transformer import Transformer
from slipstream.ops import cpu_kernels
from slipstream.ops.inference import fuse_projections, optimize_for_cpu_inference
from slipstream.ops.quant import quantize_int8
from slipstream.serve.lora import LoRAAdapter, LoRALayers, LoRARequest

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, attn_implementation="eager")
T = 7  # tokens per batch row
CPU = torch.device("cpu")


def load(path: Path, int_id: int, config: ModelConfig, *, max_rank: int = 16,
         dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    return LoRAAdapter.load(LoRARequest(f"adapter-{int_id}", int_id, str(path)), config, max_rank=max_rank,
                            dtype=dtype, device=CPU)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama directory, its transformers model and two adapters: adapter 1 on every
    projection (rank 8), adapter 2 rsLoRA on q, v and down only with ranks and alphas by pattern
    (q_proj rank 2, down_proj alpha 3), so that a fused q/k/v linear has a slice it leaves alone."""
    hf = random_hf(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SHAPE))
    root = tmp_path_factory.mktemp("lora-llama")
    model_dir = save_with_tokenizer(hf, root / "model")
    first = save_random_adapter(root / "a1", hf, rank=8, alpha=16.0, seed=1)
    second = save_random_adapter(root / "a2", hf, rank=4, alpha=6.0, seed=2, use_rslora=True,
                                 target_modules=("q_proj", "v_proj", "down_proj"), rank_pattern={"q_proj": 2})
    config = json.loads((second / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"down_proj": 3.0}
    (second / "adapter_config.json").write_text(json.dumps(config))
    return hf, model_dir, first, second


def merged_logits(hf, adapter: Path | None, token_ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits with `adapter` merged into a copy of `hf` (None: the base model)."""
    reference = hf if adapter is None else merge_adapter(copy.deepcopy(hf), adapter)
    with torch.no_grad():
        return reference(token_ids).logits


def check_rows(model: Transformer, layers: LoRALayers, hf, adapters: dict[int, Path | None],
               row_ids: list[int], *, rtol: float = 1e-5, atol: float = 2e-5) -> None:
    """Batch row b of a forward under `row_ids[b]` (0: base) equals transformers with that adapter
    merged, and the adapters change the logits far beyond the tolerance."""
    token_ids = torch.randint(1, 320, (len(row_ids), T), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), layers.rows([i for i in row_ids for _ in range(T)], CPU):
        got = positioned_logits(model, token_ids)
    base = merged_logits(hf, None, token_ids)
    for b, int_id in enumerate(row_ids):
        expected = merged_logits(hf, adapters[int_id], token_ids[b:b + 1])[0] if int_id else base[b]
        diff = (got[b] - expected).abs().max().item()
        print(f"row {b} adapter {int_id}: max |logit diff| {diff:.3g}")
        torch.testing.assert_close(got[b], expected, rtol=rtol, atol=atol, msg=f"row {b}, adapter {int_id}")
        if int_id:
            assert (expected - base[b]).abs().max() > 100 * atol  # the adapter matters
    with torch.inference_mode():  # outside `rows`: the base model
        torch.testing.assert_close(positioned_logits(model, token_ids), base, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# LoRARequest


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(lora_name="", lora_int_id=1, lora_path="/a"), "lora_name"),
    (dict(lora_name=3, lora_int_id=1, lora_path="/a"), "lora_name"),
    (dict(lora_name="a", lora_int_id=0, lora_path="/a"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=-2, lora_path="/a"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=True, lora_path="/a"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1.0, lora_path="/a"), "lora_int_id"),
    (dict(lora_name="a", lora_int_id=1), "lora_path"),
    (dict(lora_name="a", lora_int_id=1, lora_path=Path("/a")), "lora_path"),
    (dict(lora_name="a", lora_int_id=1, lora_path="/a", base_model_name=5), "base_model_name"),
])
def test_request_refuses_bad_fields(kwargs, field):
    """Guards LoRARequest's checks (vLLM's keywords): each bad field is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)
    assert LoRARequest("a", 1, "/a", base_model_name="m").lora_int_id == 1  # vLLM's positional order


def test_request_equals_by_name_and_has_vllms_aliases():
    """As vLLM's LoRARequest: equal and hashed by name; adapter_id, name and path properties."""
    request = LoRARequest("a", 1, "/a")
    assert request == LoRARequest("a", 2, "/b") and len({request, LoRARequest("a", 3, "/c")}) == 1
    assert request != LoRARequest("b", 1, "/a")
    assert (request.adapter_id, request.name, request.path) == (1, "a", "/a")


# ---------------------------------------------------------------------------------------------
# LoRAAdapter.load


def edited_config(**changes):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps(config | changes))
    return edit


def edited_tensors(change):
    def edit(directory: Path) -> None:
        tensors = load_file(directory / "adapter_model.safetensors")
        change(tensors)
        save_file(tensors, directory / "adapter_model.safetensors")
    return edit


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
HEAD = "base_model.model.lm_head"


def _set(key: str, value: torch.Tensor):
    return edited_tensors(lambda t: t.__setitem__(key, value))


def _nan(t: dict) -> None:
    t[Q_B][1, 2] = float("nan")


REFUSALS = {
    "use_dora": (edited_config(use_dora=True), "use_dora"),
    "modules_to_save": (edited_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (edited_config(bias="lora_only"), "bias"),
    "fan_in_fan_out": (edited_config(fan_in_fan_out=True), "fan_in_fan_out"),
    "lora_bias": (edited_config(lora_bias=True), "lora_bias"),
    "peft_type": (edited_config(peft_type="IA3"), "peft_type"),
    "r": (edited_config(r=0), "r must be"),
    "alpha": (edited_config(lora_alpha="16"), "lora_alpha"),
    "rank_pattern": (edited_config(rank_pattern={"q_proj": 5}), "q_proj.*rank_pattern"),
    "pattern regex": (edited_config(alpha_pattern={"q_proj(": 4}), "alpha_pattern key 'q_proj\\('"),
    "alpha too large": (edited_config(lora_alpha=1e40), "not finite in torch.float32"),
    "embedding": (_set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 320)),
                  "embed_tokens.lora_embedding_A"),
    "lm_head": (edited_tensors(lambda t: t.update({f"{HEAD}.lora_A.weight": torch.zeros(8, 64),
                                                   f"{HEAD}.lora_B.weight": torch.zeros(320, 8)})),
                "lm_head.*LM head"),
    "missing B": (edited_tensors(lambda t: t.pop(Q_B)), "q_proj has lora_A but no lora_B"),
    "A shape": (_set(Q_A, torch.zeros(8, 63)), "q_proj.*do not fit"),
    "B shape": (_set(Q_B, torch.zeros(65, 8)), "q_proj.*do not fit"),
    "A/B ranks": (_set(Q_B, torch.zeros(64, 7)), "q_proj.*rank"),
    "layer": (edited_tensors(lambda t: t.update({k.replace("layers.0", "layers.2"): t.pop(k)
                                                 for k in (Q_A, Q_B)})),
              "layers.2.*layer 2 does not exist"),
    "nan": (edited_tensors(_nan), "q_proj: lora_B holds NaN"),
    "int tensor": (_set(Q_A, torch.zeros(8, 64, dtype=torch.int32)), "q_proj.lora_A.weight must be"),
    "unknown tensor": (_set("base_model.model.model.norm.weight", torch.zeros(64)), "model.norm.weight"),
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_model.safetensors"),
    "bad json": (lambda d: (d / "adapter_config.json").write_text("{"), "adapter_config.json"),
    "corrupt weights": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 9),
                        "adapter_model.safetensors"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_load_refuses(llama, tmp_path, case):
    """Guards the adapter checks: each bad config value or tensor is a ValueError naming the
    adapter's path and the bad key or value."""
    hf, model_dir, first, _ = llama
    edit, message = REFUSALS[case]
    directory = shutil.copytree(first, tmp_path / "bad")
    edit(directory)
    with pytest.raises(ValueError, match=message) as error:
        load(directory, 1, ModelConfig.from_pretrained(model_dir))
    assert str(directory) in str(error.value)


def test_load_refuses_rank_above_max_and_missing_directory(llama, tmp_path):
    """Guards max_lora_rank (vLLM's name) and a path that is not an adapter directory."""
    _, model_dir, first, _ = llama
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank 4"):
        load(first, 1, config, max_rank=4)
    with pytest.raises(ValueError, match="is not a directory"):
        load(tmp_path / "nowhere", 1, config)


def test_load_refuses_expert_linears(tmp_path):
    """Guards the mixture-of-experts refusal: an expert's linear, the router and the dense-named
    MLP projections of a routed layer are refused; attention projections of the same layer load."""
    config = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    prefix = "base_model.model.model.layers"

    def adapter(module: str, shape: tuple[int, int]) -> Path:
        directory = tmp_path / module
        directory.mkdir()
        save_file({f"{prefix}.{module}.lora_A.weight": torch.zeros(2, shape[1]),
                   f"{prefix}.{module}.lora_B.weight": torch.zeros(shape[0], 2)},
                  directory / "adapter_model.safetensors")
        config_json = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4})
        (directory / "adapter_config.json").write_text(config_json)
        return directory

    for module, shape in [("0.mlp.experts.1.gate_proj", (24, 32)), ("0.mlp.gate", (4, 32)),
                          ("0.mlp.gate_proj", (48, 32))]:
        with pytest.raises(ValueError, match="mixture-of-experts|mixture of experts"):
            load(adapter(module, shape), 1, config)
    assert set(load(adapter("0.self_attn.q_proj", (32, 32)), 1, config).weights) == {
        "model.layers.0.self_attn.q_proj"}
    assert set(load(adapter("1.mlp.down_proj", (32, 48)), 1, config).weights) == {
        "model.layers.1.mlp.down_proj"}


def test_bin_and_adapter_named_keys_load_as_safetensors(llama, tmp_path):
    """Guards the two other layouts PEFT writes: adapter_model.bin (a torch state dict) and keys
    that keep the adapter's name (`lora_A.default.weight`); each loads the same tensors."""
    _, model_dir, first, _ = llama
    config = ModelConfig.from_pretrained(model_dir)
    expected = load(first, 1, config).weights
    directory = shutil.copytree(first, tmp_path / "bin")
    tensors = load_file(directory / "adapter_model.safetensors")
    (directory / "adapter_model.safetensors").unlink()
    torch.save({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                for k, v in tensors.items()}, directory / "adapter_model.bin")
    got = load(directory, 1, config).weights
    assert got.keys() == expected.keys() and len(got) == 14
    for name, (a, b, scaling) in got.items():
        assert torch.equal(a, expected[name][0]) and torch.equal(b, expected[name][1])
        assert scaling == expected[name][2] == 16.0 / 8


def test_scaling_follows_rslora_and_patterns(llama):
    """Guards the scaling: rsLoRA's alpha / sqrt(r), r and alpha per module from rank_pattern and
    alpha_pattern (closed form from the adapter's config)."""
    _, model_dir, _, second = llama
    adapter = load(second, 2, ModelConfig.from_pretrained(model_dir))
    assert adapter.rank == 4
    for name, (a, _, scaling) in adapter.weights.items():
        r = 2 if name.endswith("q_proj") else 4
        alpha = 3.0 if name.endswith("down_proj") else 6.0
        assert a.shape[0] == r and scaling == pytest.approx(alpha / math.sqrt(r)), name


# ---------------------------------------------------------------------------------------------
# LoRALinear


def tiny_config(**changes) -> ModelConfig:
    return ModelConfig(**dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8) | changes)


def random_adapter(int_id: int, modules: dict[str, tuple[int, int]], rank: int, scaling: float,
                   dtype: torch.dtype) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(int_id)
    weights = {f"model.layers.0.{name}": (torch.randn(rank, shape[1], generator=generator).to(dtype),
                                          torch.randn(shape[0], rank, generator=generator).to(dtype), scaling)
               for name, shape in modules.items()}
    return LoRAAdapter(name=f"a{int_id}", int_id=int_id, path=f"/a{int_id}", rank=rank, weights=weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_ids", [[1, 0, 2, 1, 2, 0, 1, 1], [2, 2, 2, 1, 1, 0, 0, 0],
                                     [1, 2] * 10 + [0, 0], [1] * 10 + [2] * 9 + [0] * 3],
                         ids=["interleaved", "contiguous", "interleaved-long", "contiguous-long"])
def test_fused_linear_matches_float64(dtype, row_ids):
    """Guards the wrapped linear's math: a fused q/k/v linear with adapter 1 on q and v (apart),
    adapter 2 on k and v (side by side: one block-diagonal expand), and base rows, interleaved or in
    runs, equals x @ (W + s B A)^T + b per row in float64 (fp32 to 1e-5; bf16 to its rounding), for
    (N, in) and (B, T, in) inputs; in bf16 both for adapters of few rows (their update in fp32) and
    of more than SMALL_GROUP_ROWS."""
    config = tiny_config(model_type="qwen2")  # q/k/v biases
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights(std=0.2)
    attn = model.model.layers[0].self_attn
    weights = {name: tuple(p.detach().double() for p in getattr(attn, name).parameters())  # (W, b)
               for name in ("q_proj", "k_proj", "v_proj")}
    fuse_projections(model.to(dtype))
    layers = LoRALayers.attach(model)
    q, kv = (32, 32), (16, 32)
    adapters = [random_adapter(1, {"self_attn.q_proj": q, "self_attn.v_proj": kv}, 4, 0.5, dtype),
                random_adapter(2, {"self_attn.k_proj": kv, "self_attn.v_proj": kv}, 3, 2.0, dtype)]
    for adapter in adapters:
        layers.add(adapter)
    x = torch.randn(len(row_ids), 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad(), layers.rows(row_ids, CPU):
        got = attn.qkv_proj(x)
        got_3d = attn.qkv_proj(x.view(2, -1, 32)).view(len(row_ids), -1)
    torch.testing.assert_close(got_3d, got, rtol=0, atol=0)
    expected = []
    for row, int_id in zip(x.double(), row_ids, strict=True):
        parts = []
        for name in ("q_proj", "k_proj", "v_proj"):
            w, b = weights[name]
            update = adapters[int_id - 1].weights.get(f"model.layers.0.self_attn.{name}") if int_id else None
            if update is not None:
                w = w + update[2] * update[1].double() @ update[0].double()
            parts.append(row @ w.T + b)
        expected.append(torch.cat(parts))
    expected = torch.stack(expected)
    scale = expected.abs().max().item()  # bf16: a few of its roundings (2^-8) of the outputs' scale
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2 * scale)
    print(f"{dtype}: max |diff| {(got.double() - expected).abs().max().item():.3g}")
    torch.testing.assert_close(got.double(), expected, **tolerance)


def test_rows_refuses_unknown_ids_and_clears():
    """Guards `rows`: an id not loaded is a ValueError, and leaving the block (also by an
    exception) returns every wrapper to the base linear; removing an adapter unloads it."""
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    model.init_weights(std=0.2)
    plain = copy.deepcopy(model)
    layers = LoRALayers.attach(model)
    layers.add(random_adapter(1, {"mlp.down_proj": (32, 48)}, 2, 1.0, torch.float32))
    assert layers.loaded_ids == {1}
    with pytest.raises(ValueError, match="7"):
        with layers.rows([0, 7], CPU):
            pass
    with pytest.raises(ValueError, match="loaded already"):
        layers.add(random_adapter(1, {"mlp.up_proj": (48, 32)}, 2, 1.0, torch.float32))
    ids, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    with torch.no_grad():
        base = plain(ids, positions)
        with pytest.raises(RuntimeError, match="inside"), layers.rows([1, 1, 1], CPU):
            assert not torch.allclose(model(ids, positions), base)
            raise RuntimeError("inside")
        torch.testing.assert_close(model(ids, positions), base, rtol=0, atol=0)
        layers.remove(1)
        with pytest.raises(ValueError, match="1"), layers.rows([1, 1, 1], CPU):
            pass
    assert layers.loaded_ids == frozenset()
    with pytest.raises(KeyError):
        layers.remove(1)


def test_add_refuses_module_without_wrapper():
    """Guards `add`'s all-or-nothing check: an adapter with one module the model lacks loads
    nowhere."""
    model = Transformer(tiny_config())
    layers = LoRALayers.attach(model)
    adapter = random_adapter(1, {"mlp.down_proj": (32, 48), "mlp.experts.0.down_proj": (32, 48)}, 2, 1.0,
                             torch.float32)
    with pytest.raises(ValueError, match="experts.0.down_proj"):
        layers.add(adapter)
    assert layers.loaded_ids == frozenset()
    with pytest.raises(ValueError, match="wrapped already"):
        LoRALayers.attach(model)


# ---------------------------------------------------------------------------------------------
# Whole models against transformers with the adapter merged


@pytest.mark.parametrize("row_ids", [[1, 1], [2, 0, 1, 2]], ids=["one-adapter", "mixed"])
def test_model_matches_merged_transformers(llama, row_ids):
    """Guards the whole path on the plain model: batch rows under adapter 1, adapter 2 (rsLoRA,
    patterns, q/v/down only) or none, equal transformers with each adapter merged (fp32)."""
    hf, model_dir, first, second = llama
    config = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir)
    layers = LoRALayers.attach(model)
    layers.add(load(first, 1, config))
    layers.add(load(second, 2, config))
    check_rows(model, layers, hf, {1: first, 2: second}, row_ids)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
def test_optimized_model_matches_merged_transformers(llama):
    """Guards the wrappers inside the CPU fast path (fused q/k/v and gate/up, packed linears, the
    kernel decoder): interleaved rows of two adapters and the base equal the merged references."""
    hf, model_dir, first, second = llama
    config = ModelConfig.from_pretrained(model_dir)
    model = optimize_for_cpu_inference(load_model(model_dir).eval())
    layers = LoRALayers.attach(model)
    layers.add(load(first, 1, config))
    layers.add(load(second, 2, config))
    check_rows(model, layers, hf, {1: first, 2: second}, [1, 2, 0, 1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")
def test_int8_model_matches_merged_int8_weights(llama):
    """Guards the wrappers over int8 linears: our int8 model with adapters equals transformers whose
    projections hold the same int8 values times their scales (ops.quant.quantize_int8), merged."""
    hf, model_dir, first, second = llama
    config = ModelConfig.from_pretrained(model_dir)
    model = optimize_for_cpu_inference(load_model(model_dir).eval(), quantization="int8")
    layers = LoRALayers.attach(model)
    layers.add(load(first, 1, config))
    layers.add(load(second, 2, config))
    quantized = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                q, scale = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
    check_rows(model, layers, quantized, {1: first, 2: second}, [2, 1, 0], rtol=1e-4, atol=1e-4)


FAMILIES = {
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, ALL_PROJECTIONS),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, ("qkv_proj", "o_proj", "gate_up_proj",
                                                                    "down_proj")),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_match_merged_transformers(tmp_path, family):
    """Guards two more families on the plain model, rows under one adapter and the base: Qwen2
    (q/k/v biases) and Phi-3, whose adapters target its checkpoint's fused qkv_proj and
    gate_up_proj, split here over the model's q/k/v and gate/up with one A each."""
    model_class, config_class, targets = FAMILIES[family]
    hf = random_hf(model_class, config_class(**SHAPE), names=("norm", "bias"))
    model_dir = save_with_tokenizer(hf, tmp_path / "model")
    adapter = save_random_adapter(tmp_path / "a", hf, rank=4, alpha=8.0, seed=4, target_modules=targets)
    model = load_model(model_dir)
    layers = LoRALayers.attach(model)
    layers.add(load(adapter, 3, ModelConfig.from_pretrained(model_dir)))
    check_rows(model, layers, hf, {3: adapter}, [0, 3])
