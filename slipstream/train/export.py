"""Export a training run's checkpoint as a Hugging Face model directory.

The result holds `config.json`, `model.safetensors`, the tokenizer the data was prepared with and
`generation_config.json` (every end-of-sequence id), so `transformers.AutoModelForCausalLM`,
`AutoTokenizer` and `slipstream.LLM` all load it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from slipstream.model import ModelConfig, Transformer, save_model
from slipstream.model.weights import new_model_dir
from slipstream.train.checkpoint import find_checkpoint, load_model_state

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def export_run(
    run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write the checkpoint of `step` (default: the newest) of `run_dir` to `out_dir`, a new or
    empty directory (or any, replaced whole, with `overwrite`), put in place only once complete
    (`new_model_dir`); returns the checkpoint directory it read."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    checkpoint_dir = find_checkpoint(run_dir, step)
    tokenizer_dir = run_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir} has no tokenizer.json; is {run_dir} a training run?")
    config = ModelConfig.from_pretrained(checkpoint_dir)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(load_model_state(checkpoint_dir), strict=True, assign=True)
    model.tie_weights()
    with new_model_dir(out_dir, overwrite=overwrite) as staging:
        save_model(model, staging, dtype=dtype)
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, staging / name)
    logger.info("exported %s to %s", checkpoint_dir, out_dir)
    return checkpoint_dir
