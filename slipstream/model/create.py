"""Create a complete, randomly initialised Hugging Face model directory from a preset.

The directory holds `config.json`, `generation_config.json`, `model.safetensors` and a byte-level
BPE tokenizer trained on the embedded corpus (the standard library's sources) with a ChatML chat
template, so that both slipstream and `transformers.AutoModelForCausalLM` / `AutoTokenizer` load
it. Trained tokenizers are cached per vocabulary size and corpus, because training one takes
seconds to a minute and every model of that vocabulary size can share it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch

from slipstream.cache import cache_dir
from slipstream.corpus import stdlib_files
from slipstream.model.config import ModelConfig
from slipstream.model.presets import get_preset
from slipstream.model.tokenizer import Tokenizer, train_tokenizer
from slipstream.model.transformer import Transformer
from slipstream.model.weights import new_model_dir, save_model

logger = logging.getLogger(__name__)

# Tokenizers train on an evenly spread sample of this size: the whole stdlib (~31 MB) takes
# several times longer and gives nearly the same merges for these vocabulary sizes.
TOKENIZER_CORPUS_BYTES = 8_000_000
_TOKENIZER_RECIPE_VERSION = 1


def create_model_dir(
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ModelConfig:
    """Write a randomly initialised model of `preset` with its tokenizer to `out_dir`."""
    spec = get_preset(preset)
    if spec.config_only:
        raise ValueError(
            f"preset {preset!r} ({spec.description}) is a planning shape too large to initialise "
            "here; use it with `slipstream perf`, or pick tiny, tiny-moe, tiny-gemma2, small or medium"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    with new_model_dir(out_dir, overwrite=overwrite) as staging:
        tokenizer = stdlib_tokenizer(spec.config.vocab_size)
        config = spec.config.replace(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device="cpu")
        model.init_weights(generator=torch.Generator().manual_seed(seed))
        save_model(model, staging, dtype=dtype)
        _save_tokenizer(tokenizer, staging)
    logger.info("wrote %s model (%s) to %s", preset, spec.description, out_dir)
    return config.replace(dtype=dtype)


def stdlib_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` trained on the standard library, cached on disk."""
    files = stdlib_files()
    fingerprint = hashlib.sha256(
        json.dumps([
            _TOKENIZER_RECIPE_VERSION, vocab_size, TOKENIZER_CORPUS_BYTES,
            platform.python_version(), len(files), sum(f.stat().st_size for f in files),
        ]).encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"stdlib-{vocab_size}-{fingerprint}"
    if (cached / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(cached)
    logger.info("training a %d-token BPE tokenizer on the standard library", vocab_size)
    tokenizer = train_tokenizer(files, vocab_size, max_bytes=TOKENIZER_CORPUS_BYTES)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    _save_tokenizer(tokenizer, tmp)
    try:
        os.rename(tmp, cached)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, model_dir: Path) -> None:
    """Tokenizer files plus the generation_config.json that lists every end-of-sequence id
    (`<|im_end|>` as well as `<|endoftext|>`), which is where Hugging Face keeps that list."""
    tokenizer.save_pretrained(model_dir)
    generation = {"eos_token_id": list(tokenizer.eos_token_ids), "pad_token_id": tokenizer.pad_token_id}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
