"""The model: config, the decoder, weights and tokenizer. Pure math; no distributed, paging or
training code lives here."""

from slipstream.model.config import ModelConfig, RopeScaling
from slipstream.model.transformer import Transformer
from slipstream.model.weights import load_model, save_model

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "load_model", "save_model"]
