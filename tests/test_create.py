"""`slipstream init-model`: a complete model directory that slipstream and transformers both load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from slipstream.model import ModelConfig, load_model
from slipstream.model.create import create_model_dir
from slipstream.model.presets import PRESETS, get_preset
from slipstream.model.tokenizer import Tokenizer
from slipstream.perf.flops import num_params


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "init-model", "--preset", "tiny", str(out)],
        check=True, capture_output=True, text=True,
    )
    return out


def test_init_model_loads_in_transformers_with_equal_logits(tiny_dir):
    """The directory loads in AutoModelForCausalLM and AutoTokenizer, with the same logits and
    token ids as slipstream."""
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    text = "def greet(name):\n    return f'hello {name}'\n"
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    ours = load_model(tiny_dir)
    token_ids = torch.tensor([ids])
    with torch.no_grad():
        diff = (ours(token_ids, torch.arange(len(ids))[None]) - hf_model(token_ids).logits).abs().max()
    print(f"max |logit diff| = {diff.item():.3g}")
    assert diff < 1e-4


def test_init_model_directory_contents(tiny_dir):
    """config, generation config (both end-of-sequence ids) and a chat template are present."""
    config = ModelConfig.from_pretrained(tiny_dir)
    assert num_params(config) == num_params(get_preset("tiny").config)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    assert set(generation["eos_token_id"]) == set(tokenizer.eos_token_ids) == {0, 2}
    assert len(tokenizer) <= config.vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")


def test_presets_have_the_sizes_their_names_say():
    """tiny is ~15M, small ~125M parameters; the real shapes match their published counts
    (Meta's model cards: 1.24B, 8.03B, 70.6B, 405B)."""
    expected_millions = {"tiny": 15.7, "small": 125, "llama3.2-1b": 1240, "llama3-8b": 8030,
                         "llama3-70b": 70600, "llama3-405b": 405000}
    for name, millions in expected_millions.items():
        assert num_params(PRESETS[name].config) / 1e6 == pytest.approx(millions, rel=5e-3), name


def test_bad_requests_are_clear_errors(tmp_path, tiny_dir):
    """Unknown presets, config-only shapes and non-empty targets are refused with a message."""
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        create_model_dir("huge", tmp_path / "a")
    with pytest.raises(ValueError, match="llama3-8b"):
        create_model_dir("llama3-8b", tmp_path / "b")
    with pytest.raises(ValueError, match="not empty"):
        create_model_dir("tiny", tiny_dir)
    result = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "init-model", "--preset", "huge", str(tmp_path / "c")],
        capture_output=True, text=True,
    )
    assert result.returncode == 2 and "unknown preset 'huge'" in result.stderr


def test_a_model_dir_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """The model is written into a hidden sibling and renamed into place once complete: a failure
    (or a kill) part way leaves OUT_DIR as it was, the old model included; --overwrite replaces it
    whole (a stale file of the old one does not survive); an empty path or a file is refused."""
    from slipstream.model import create

    out = tmp_path / "m"
    create_model_dir("tiny", out)
    (out / "chat_template.jinja").write_text("{{ 'STALE' }}")
    before = sorted(p.name for p in out.iterdir())

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(create, "_save_tokenizer", killed)  # after the weights are written
    with pytest.raises(KeyboardInterrupt):
        create_model_dir("tiny", out, seed=5, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging directory left behind
    create_model_dir("tiny", out, seed=5, overwrite=True)
    assert not (out / "chat_template.jinja").exists()
    for bad, message in (("", "empty path"), (str(out / "config.json"), "is not a directory")):
        with pytest.raises(ValueError, match=message):
            create_model_dir("tiny", bad)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        create_model_dir("tiny", tmp_path / "n", seed=10**23)
