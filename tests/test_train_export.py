"""`slipstream export`: a training run's checkpoint becomes a Hugging Face model directory that
transformers and slipstream's serving engine both load and agree on."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import small_config

from slipstream.cli import main
from slipstream.model import load_model
from slipstream.train.checkpoint import load_model_state
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

PROMPT = "def main():\n    "


@pytest.fixture(scope="module")
def trained_run(data_dir, train_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    config = small_config(data_dir, train_model_dir, run_dir, "--training.steps=30", "--optimizer.lr=3e-3",
                          "--checkpoint.interval=15", "--checkpoint.save_final=true")
    Trainer(config).run()
    return run_dir


def test_export_loads_in_transformers_and_the_engine(trained_run, tmp_path, capsys):
    """transformers' greedy generate and slipstream.LLM (temperature 0) produce the same tokens
    from the exported directory, and the same logits (1e-4) as slipstream's model; its tokenizer
    loads in AutoTokenizer and encodes identically."""
    transformers = pytest.importorskip("transformers")
    from slipstream import LLM, SamplingParams

    out = tmp_path / "exported"
    assert main(["export", str(trained_run), str(out)]) == 0
    assert "step-00000030" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    llm = LLM(str(out))
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert hf_tokenizer(PROMPT)["input_ids"] == prompt_ids
    expected = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
    print(f"greedy tokens: {got}")
    assert got == expected
    ids = torch.tensor([prompt_ids + got])
    with torch.no_grad():
        hf_logits = hf_model(ids).logits
        ours = load_model(out)(ids, torch.arange(ids.shape[1])[None])
    diff = (hf_logits - ours).abs().max().item()
    print(f"max |transformers - slipstream| logit difference: {diff:.1e}")
    assert diff < 1e-4


def test_export_of_an_earlier_step(trained_run, tmp_path):
    """--step picks an older checkpoint: its weights are exactly that checkpoint's; a step with no
    checkpoint is an error listing the steps there are."""
    out = tmp_path / "step15"
    assert main(["export", str(trained_run), str(out), "--step", "15"]) == 0
    exported = load_file(out / "model.safetensors")
    saved = load_model_state(trained_run / "checkpoints" / "step-00000015")
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
    assert main(["export", str(trained_run), str(tmp_path / "x"), "--step", "7"]) == 2
