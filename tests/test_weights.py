"""Safetensors weight I/O: layouts, dtypes, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.model import ModelConfig, Transformer, load_model, save_model
from slipstream.model.weights import new_model_dir

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def _model(config: ModelConfig = CONFIG, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights()
    return model


def _assert_same_weights(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name].to(sa[name].dtype)), name


def test_sharded_round_trip(tmp_path):
    """Past max_shard_bytes the weights are split into shards with an index; loading reads all."""
    model = _model()
    save_model(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    _assert_same_weights(model, load_model(tmp_path))


def test_resave_single_file_removes_old_shards(tmp_path):
    """Saving over a sharded directory leaves exactly one consistent layout behind."""
    save_model(_model(), tmp_path, max_shard_bytes=20_000)
    save_model(_model(seed=1), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    _assert_same_weights(_model(seed=1), load_model(tmp_path))


@pytest.mark.parametrize("save_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("load_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_conversion(tmp_path, save_dtype, load_dtype):
    """Weights are stored in the requested dtype, config.json records it, and loading converts."""
    model = _model()
    save_model(model, tmp_path, dtype=save_dtype)
    stored = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {getattr(torch, save_dtype)}
    assert ModelConfig.from_pretrained(tmp_path).dtype == save_dtype
    loaded = load_model(tmp_path, dtype=load_dtype)
    assert {p.dtype for p in loaded.parameters()} == {load_dtype}
    expected = model.model.embed_tokens.weight.to(getattr(torch, save_dtype)).to(load_dtype)
    assert torch.equal(loaded.model.embed_tokens.weight, expected)


def test_tied_embeddings_saved_once_and_retied(tmp_path):
    """A tied lm_head is not written (as HF does) and is shared again after loading."""
    model = _model(CONFIG.replace(tie_word_embeddings=True))
    save_model(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("load_dtype", [torch.float32, torch.bfloat16])
def test_a_stored_lm_head_that_tying_replaces_is_named_if_it_differs(tmp_path, caplog, load_dtype):
    """Tied, a checkpoint's own lm_head.weight is not used (as vLLM skips it); one that differs
    from the embedding gets a warning (transformers 5 would keep it), a copy of it none."""
    model = _model(CONFIG.replace(tie_word_embeddings=True))
    save_model(model, tmp_path)
    embedding = model.model.embed_tokens.weight.detach()
    for head, warned in ((embedding.clone(), False), (embedding + 1.0, True)):
        _resave_without(tmp_path, add={"lm_head.weight": head.contiguous()})
        caplog.clear()
        with caplog.at_level("WARNING", logger="slipstream.model.weights"):
            loaded = load_model(tmp_path, dtype=load_dtype)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert ("lm_head.weight, which differs from the embedding, is not used" in caplog.text) == warned


def _resave_without(tmp_path, drop: str | None = None, add: dict | None = None) -> None:
    tensors = load_file(tmp_path / "model.safetensors")
    if drop:
        del tensors[drop]
    tensors |= add or {}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    """A checkpoint lacking a parameter is a ValueError naming it."""
    save_model(_model(), tmp_path)
    _resave_without(tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    """A tensor whose shape disagrees with config.json is a ValueError naming both shapes."""
    save_model(_model(), tmp_path)
    _resave_without(tmp_path, add={"model.norm.weight": torch.ones(31)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(31,\).*\(32,\)"):
        load_model(tmp_path)


def test_unexpected_weight_is_named(tmp_path):
    """A tensor the model has no place for is an error, not silently dropped."""
    save_model(_model(), tmp_path)
    _resave_without(tmp_path, add={"model.layers.0.mystery.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"unexpected.*mystery"):
        load_model(tmp_path)


def test_truncated_file_is_a_clear_error(tmp_path):
    """A truncated safetensors file is a ValueError naming the file, not a crash."""
    save_model(_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    for keep in (len(data) - 100, 200, 5):
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="model.safetensors"):
            load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    """An index that points at a shard that is not there names the shard."""
    save_model(_model(), tmp_path, max_shard_bytes=20_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model(tmp_path)


def test_pickle_checkpoints_are_never_read(tmp_path):
    """A directory with only a pickled pytorch_model.bin is refused: we read safetensors only."""
    model = _model()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_holds_one_copy_of_the_weights(tmp_path, dtype):
    """Peak memory while loading (VmHWM of a fresh process, all weights touched) stays within one
    copy of the loaded weights plus the largest single tensor: stored-dtype weights are views of
    the memory-mapped file, converted ones are converted tensor by tensor."""
    config = ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=2048,
                         num_hidden_layers=8, num_attention_heads=8)
    model = _model(config)
    save_model(model, tmp_path)
    loaded_bytes = sum(p.numel() for p in model.parameters()) * getattr(torch, dtype).itemsize
    largest_stored_bytes = max(p.numel() for p in model.parameters()) * 4
    script = textwrap.dedent(f"""
        import torch
        from slipstream.model import load_model
        def status(key):
            return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) * 1024
        base = status('VmRSS')
        model = load_model({str(tmp_path)!r}, dtype=torch.{dtype})
        for p in model.parameters():
            p.data.view(-1)[::1024].sum()  # touch every page of every weight
        print(status('VmHWM') - base)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    peak_growth_bytes = int(out.stdout.split()[-1])
    budget_bytes = loaded_bytes + largest_stored_bytes + 96 * 2**20  # torch runtime start-up
    print(f"{dtype}: weights {loaded_bytes / 1e6:.0f} MB loaded, peak RSS grew "
          f"{peak_growth_bytes / 1e6:.0f} MB (budget {budget_bytes / 1e6:.0f} MB)")
    assert peak_growth_bytes < budget_bytes


def test_dtype_names_include_vllms():
    """vLLM's --dtype names (auto aside) resolve as vLLM reads them; others are refused by name."""
    from slipstream.model.weights import resolve_dtype

    expected = {"float": torch.float32, "float32": torch.float32, "half": torch.float16,
                "float16": torch.float16, "bfloat16": torch.bfloat16}
    assert {name: resolve_dtype(name) for name in expected} == expected
    with pytest.raises(ValueError, match="'double'"):
        resolve_dtype("double")


@pytest.mark.parametrize("weight_map", [["model-00001-of-00002.safetensors"], {"model.norm.weight": 5}, "x"])
def test_malformed_index_is_named(tmp_path, weight_map):
    """An index whose weight_map is not a map of tensor names to file names is a ValueError naming
    the index, not an AttributeError or TypeError from deep inside the loader."""
    save_model(_model(), tmp_path, max_shard_bytes=20_000)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not a valid safetensors index"):
        load_model(tmp_path)


def _forget_dtype(model_dir) -> None:
    """Remove what config.json says of the dtype, as some checkpoints' config.json leaves it out."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("save_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_a_dtype_config_json_leaves_out_is_read_from_the_headers(tmp_path, save_dtype, max_shard_bytes):
    """Where config.json names no dtype, the config's dtype is the one the safetensors headers
    record (as vLLM's dtype="auto" reads it), not float32, and loading in it keeps the file's
    tensors; without safetensors the fallback is float32 (vLLM's too)."""
    from slipstream.model.weights import stored_dtype

    save_model(_model(), tmp_path, dtype=save_dtype, max_shard_bytes=max_shard_bytes)
    _forget_dtype(tmp_path)
    assert stored_dtype(tmp_path) == getattr(torch, save_dtype)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.dtype == save_dtype
    loaded = load_model(tmp_path, dtype=config.dtype)
    assert {p.dtype for p in loaded.parameters()} == {getattr(torch, save_dtype)}
    for path in tmp_path.glob("model*.safetensors*"):
        path.unlink()
    assert stored_dtype(tmp_path) is None and ModelConfig.from_pretrained(tmp_path).dtype == "float32"


def test_mixed_stored_dtypes_read_as_float32(tmp_path):
    """A checkpoint whose tensors are of several dtypes reads as float32, which each converts to
    without loss (vLLM's rule)."""
    from slipstream.model.weights import stored_dtype

    save_model(_model(), tmp_path, dtype="bfloat16")
    _forget_dtype(tmp_path)
    _resave_without(tmp_path, add={"model.norm.weight": torch.ones(32)})
    assert stored_dtype(tmp_path) == torch.float32
    assert ModelConfig.from_pretrained(tmp_path).dtype == "float32"


def test_auto_dtype_of_a_transformers_checkpoint_without_dtype(tmp_path):
    """A bf16 checkpoint written by transformers, whose config.json names no dtype, is served in
    bf16 under dtype="auto" (vLLM reads the headers), not in float32 at twice the memory."""
    transformers = pytest.importorskip("transformers")
    from slipstream import LLM
    from slipstream.model.create import stdlib_tokenizer

    hf_config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4)
    transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).save_pretrained(tmp_path)
    stdlib_tokenizer(320).save_pretrained(tmp_path)
    _forget_dtype(tmp_path)
    assert LLM(str(tmp_path), kv_cache_memory=2**22).engine.limits.dtype == torch.bfloat16


def test_new_model_dir_removes_only_a_killed_calls_leftovers(tmp_path):
    """A call removes the staging folders a killed call for the same name left, and neither the one
    a running call is writing (two exports at once into one folder) nor another name's that begins
    with this one (`out-b` beside `out`)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    killed = tmp_path / f".tmp-out-{child.pid}-0123abcd"
    running = tmp_path / f".tmp-out-{os.getpid()}-89abcdef"
    other_name = tmp_path / f".tmp-out-b-{child.pid}-0123abcd"
    for folder in (killed, running, other_name):
        folder.mkdir()
    with new_model_dir(tmp_path / "out") as staging:
        (staging / "config.json").write_text("{}")
    assert (tmp_path / "out" / "config.json").is_file()
    assert not killed.exists() and running.is_dir() and other_name.is_dir()


PHI3 = CONFIG.replace(model_type="phi3", sliding_window=9)


def test_phi3_fused_tensors_round_trip_and_split_as_transformers_splits_them(tmp_path):
    """A Phi-3 checkpoint stores each layer's q/k/v and gate/up as one tensor (rows stacked in that
    order: transformers' Phi3Attention slices q, k, v from qkv_proj's output and Phi3MLP chunks
    gate_up_proj's into gate, up); saving fuses them so, loading splits them back, sharded too."""
    model = _model(PHI3)
    save_model(model, tmp_path, max_shard_bytes=20_000)
    stored = {}
    for path in tmp_path.glob("*.safetensors"):
        stored |= load_file(path)
    assert not any(".q_proj." in n or ".gate_proj." in n for n in stored)
    kv = PHI3.num_key_value_heads * PHI3.head_dim
    for i, layer in enumerate(model.model.layers):
        q, k, v = stored[f"model.layers.{i}.self_attn.qkv_proj.weight"].split([PHI3.hidden_size, kv, kv])
        gate, up = stored[f"model.layers.{i}.mlp.gate_up_proj.weight"].chunk(2)
        attention, mlp = layer.self_attn, layer.mlp
        for got, param in ((q, attention.q_proj), (k, attention.k_proj), (v, attention.v_proj),
                           (gate, mlp.gate_proj), (up, mlp.up_proj)):
            assert torch.equal(got, param.weight)
    _assert_same_weights(model, load_model(tmp_path))


def test_phi3_fused_tensor_of_the_wrong_shape_or_missing_is_named(tmp_path):
    """A fused tensor whose rows do not add up to the config's q/k/v (or gate/up) is a ValueError
    naming it and both shapes; a missing one is named by its stored (fused) name, once."""
    save_model(_model(PHI3), tmp_path)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    _resave_without(tmp_path, add={name: torch.ones(63, 32)})
    with pytest.raises(ValueError, match=r"qkv_proj\.weight has shape \(63, 32\).*\(64, 32\) \(in .*\)"):
        load_model(tmp_path)
    _resave_without(tmp_path, drop=name)
    with pytest.raises(ValueError, match=r"missing from .*: model\.layers\.1\.self_attn\.qkv_proj\.weight$"):
        load_model(tmp_path)
