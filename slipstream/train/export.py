"""Export a training run's checkpoint as a Hugging Face model directory.

The result holds `config.json`, `model.safetensors`, the tokenizer the data was prepared with and
`generation_config.json` (every end-of-sequence id), so `transformers.AutoModelForCausalLM`,
`AutoTokenizer` and `slipstream.LLM` all load it, and AutoTokenizer gives the ids the data was
tokenized with: a run whose model type makes transformers build another tokenizer pipeline than
its data's (`tokenization_mismatch`) is refused, and so is an export directory that would
replace the run.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from slipstream.model import ModelConfig, Transformer, save_model
from slipstream.model.tokenizer import Tokenizer, pipeline_differences, rebuilt_pipeline
from slipstream.model.weights import new_model_dir
from slipstream.train.checkpoint import CHECKPOINTS_DIR, find_checkpoint, load_model_state
from slipstream.train.data import TOKENIZER_DIR, TOKENIZER_FILES

logger = logging.getLogger(__name__)

_NO_DEFAULT_TOKENS = ("unk_token", "pad_token")
"""Special tokens that a tokenizer class of transformers' own may default to a token of its
choosing when tokenizer_config.json leaves them out (Qwen2Tokenizer: "<|endoftext|>", added to
the vocabulary if it lacks it, which then encodes that text as one token): an exported
tokenizer_config.json sets each slipstream has none of to null."""


def export_run(
    run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write the checkpoint of `step` (default: the newest) of `run_dir` to `out_dir`, a new or
    empty directory (or any, replaced whole, with `overwrite`), put in place only once complete
    (`new_model_dir`); returns the checkpoint directory it read."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    _check_apart(run_dir, out_dir)
    checkpoint_dir = find_checkpoint(run_dir, step)
    tokenizer_dir = run_dir / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir} has no tokenizer.json; is {run_dir} a training run?")
    config = ModelConfig.from_pretrained(checkpoint_dir)
    mismatch = tokenization_mismatch(tokenizer_dir, config.model_type)
    if mismatch is not None:
        raise ValueError(f"cannot export {run_dir}: {mismatch}")
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(load_model_state(checkpoint_dir), strict=True, assign=True)
    model.tie_weights()
    with new_model_dir(out_dir, overwrite=overwrite) as staging:
        save_model(model, staging, dtype=dtype)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, staging / name)
        _write_no_default_tokens(staging / "tokenizer_config.json")
    logger.info("exported %s to %s", checkpoint_dir, out_dir)
    return checkpoint_dir


def tokenization_mismatch(tokenizer_dir: Path, model_type: str) -> str | None:
    """Why a model of `model_type` exported with the tokenizer in `tokenizer_dir` would be fed
    other ids by transformers' `AutoTokenizer` (and so vLLM, and slipstream's own `Tokenizer`,
    which reads a model directory as it does) than the data was tokenized with, or None.
    transformers builds its own pipeline for some model types whatever tokenizer_config.json
    names (qwen2: Qwen2's pre-tokenizer and NFC; `tokenizer.rebuilt_pipeline`), and a tokenizer
    without that pipeline cannot be written so that it keeps its own. Where transformers reads
    the file as it is, nothing is loaded."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if rebuilt_pipeline(config, model_type) is None:
        return None
    trained = Tokenizer.from_pretrained(tokenizer_dir)
    served = Tokenizer.from_pretrained(tokenizer_dir, model_type=model_type)
    differences = pipeline_differences(trained, served)
    if not differences:
        return None
    return (f"transformers (AutoTokenizer, and so vLLM) reads the tokenizer of a {model_type} model with "
            f"its own {' and '.join(differences)}, not those of the tokenizer the data was prepared with "
            f"({tokenizer_dir}), so the model would be given other ids than it was trained on; prepare "
            "the data with a tokenizer that has that model type's pipeline (`slipstream data prepare "
            "--tokenizer MODEL_DIR` with the model's own directory) and train on it")


def _check_apart(run_dir: Path, out_dir: Path) -> None:
    """ValueError when writing `out_dir` would replace the run or what the export reads: the run
    dir itself, a folder holding it, or a place inside its checkpoints or tokenizer (symbolic
    links resolved)."""
    run, out = run_dir.resolve(), out_dir.resolve()
    read = (run / CHECKPOINTS_DIR, run / TOKENIZER_DIR)
    if run.is_relative_to(out) or any(out.is_relative_to(path) for path in read):
        raise ValueError(f"the export directory {str(out_dir)!r} ({out}) would replace the training run "
                         f"{str(run_dir)!r} ({run}) or part of it; export to a directory outside the run")


def _write_no_default_tokens(config_path: Path) -> None:
    """Set each of `_NO_DEFAULT_TOKENS` that the tokenizer_config.json at `config_path` leaves out
    to null, so that AutoTokenizer gives the ids slipstream does whatever class it builds."""
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    missing = [name for name in _NO_DEFAULT_TOKENS if name not in config]
    if missing:
        config.update(dict.fromkeys(missing))
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
