"""`slipstream export`: a training run's checkpoint becomes a Hugging Face model directory that
transformers and slipstream's serving engine both load and agree on."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import VOCAB_SIZE, corpus, model_dir, qwen2_style_tokenizer, small_config

from slipstream.cli import main
from slipstream.model import load_model
from slipstream.model.tokenizer import Tokenizer
from slipstream.train import export
from slipstream.train.checkpoint import load_model_state
from slipstream.train.data import prepare_dataset
from slipstream.train.export import export_run
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


def test_export_never_writes_over_the_run(trained_run, tmp_path):
    """An export directory that is the run, holds it, or lies in its checkpoints or tokenizer
    (symbolic links resolved) is refused before anything is written, with --overwrite too: it
    replaced the run's checkpoints, metrics and config (or every run beside it) with the export."""
    runs = tmp_path / "runs"
    run = runs / "myrun"
    shutil.copytree(trained_run, run)
    (runs / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(run)
    before = {p.relative_to(tmp_path).as_posix(): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for out in (run, tmp_path / "link", runs, tmp_path, run / "checkpoints", run / "checkpoints" / "hf",
                run / "checkpoints" / "step-00000030", run / "tokenizer"):
        with pytest.raises(ValueError, match=f"{re.escape(str(out))}.* would replace the training run "
                                             f"{re.escape(repr(str(run)))}"):
            export_run(run, out, overwrite=True)
        assert main(["export", str(run), str(out), "--overwrite"]) == 2
    assert {p.relative_to(tmp_path).as_posix(): p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    assert main(["export", str(run), str(run / "hf")]) == 0  # a new folder inside the run is fine


TOKENIZATION_TEXTS = ["def foo(x):\n    return x\n", "It's 12345 apples; we'll SEE!!\n\n\n  ok  ",
                      "caf\u00e9 cafe\u0301 \u4f60\u597d 🙂\r\n", "<|endoftext|>x<|endoftext|>"]


def _train_and_export(data, model_type, tmp_path):
    model = model_dir(tmp_path / f"{model_type}-model", data, model_type=model_type)
    run = tmp_path / f"{model_type}-run"
    Trainer(small_config(data, model, run, "--training.steps=2", "--checkpoint.save_final=true")).run()
    return run


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_an_exported_model_is_tokenized_as_in_training(model_type, data_dir, tmp_path, caplog):
    """AutoTokenizer (what transformers and vLLM use) gives an exported model of every family the
    ids its data was tokenized with. For a qwen2 model transformers builds Qwen2Tokenizer's own
    pipeline whatever the tokenizer files say, so data prepared with another byte-level BPE (the
    default) cannot be exported as qwen2: the trainer warns at start and export refuses; data
    prepared with a tokenizer of Qwen2's pipeline exports."""
    transformers = pytest.importorskip("transformers")
    run = _train_and_export(data_dir, model_type, tmp_path)
    out = tmp_path / "exported"
    if model_type == "qwen2":
        assert "`slipstream export` will refuse this run" in caplog.text
        with pytest.raises(ValueError, match="reads the tokenizer of a qwen2 model with its own normalizer "
                                             "and pre_tokenizer"):
            export_run(run, out)
        assert not out.exists()
        data = tmp_path / "qwen2-data"
        prepare_dataset(data, qwen2_style_tokenizer([d.path for d in corpus()], VOCAB_SIZE), corpus(),
                        heldout_fraction=0.1, progress=False)
        caplog.clear()
        run = _train_and_export(data, model_type, tmp_path / "qwen2-style")
        assert "will refuse" not in caplog.text
    export_run(run, out)
    trained = Tokenizer.from_pretrained(run / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    served = Tokenizer.from_pretrained(out)
    for text in [*TOKENIZATION_TEXTS, corpus()[0].path.read_text()]:
        ids = trained.encode(text, add_special_tokens=False)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids
        assert served.encode(text, add_special_tokens=False) == ids


def test_an_export_sets_the_special_tokens_that_transformers_would_default(tmp_path):
    """transformers' Qwen2Tokenizer takes "<|endoftext|>" for an unk_token and pad_token that
    tokenizer_config.json leaves out, adding it to a vocabulary without it, so that text would
    encode as one new id instead of the ids the data was tokenized with: export writes both as
    null where slipstream's tokenizer has none (repro of the review: qwen/unk.py)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = qwen2_style_tokenizer([d.path for d in corpus()], VOCAB_SIZE, eos_token="</s>",
                                      pad_token=None)
    assert "<|endoftext|>" not in tokenizer.get_vocab()
    data = tmp_path / "data"
    prepare_dataset(data, tokenizer, corpus(), heldout_fraction=0.1, progress=False)
    run, out = _train_and_export(data, "qwen2", tmp_path), tmp_path / "exported"
    export_run(run, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["unk_token"] is None and config["pad_token"] is None and config["eos_token"] == "</s>"
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf) == len(tokenizer)
    for text in [*TOKENIZATION_TEXTS, "hello <|endoftext|> world"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids
    assert Tokenizer.from_pretrained(out).pad_token_id is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_tokenization_mismatch_loads_nothing_without_a_rebuilt_pipeline(model_type, data_dir, monkeypatch):
    """The trainer asks at every start: for a model type whose tokenizer transformers reads as it
    is (the data's tokenizer_config.json names PreTrainedTokenizerFast), no tokenizer is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("loaded a tokenizer")

    monkeypatch.setattr(export.Tokenizer, "from_pretrained", refuse)
    assert export.tokenization_mismatch(data_dir / "tokenizer", model_type) is None
    with pytest.raises(AssertionError, match="loaded a tokenizer"):
        export.tokenization_mismatch(data_dir / "tokenizer", "qwen2")
