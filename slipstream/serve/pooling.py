"""Embeddings from the decoder: vLLM's pooling runner (`LLM(..., runner="pooling")`, `LLM.embed`,
`/v1/embeddings`).

A pooling engine runs prompts only. Each is computed as a generation request's prompt is
(chunked under the token budget, paged, preempted when blocks run out), and the step that
computes its last prompt token pools the final-norm hidden states instead of sampling: the last
token's (LAST: the default for decoder models, as in vLLM, and what Qwen3-Embedding and the
Mistral-based embedders use), the mean over the prompt (MEAN) or the first token's (CLS), as the
model directory's sentence-transformers files say (`modules.json` and its Pooling module's
`config.json`). The result is L2-normalised where those files list a Normalize module, or where
there are no such files (vLLM's default), and a Matryoshka model (`is_matryoshka` or
`matryoshka_dimensions` in config.json, as vLLM reads them) may keep only its first `dimensions`
before normalising.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from slipstream.model.config import ModelConfig
from slipstream.serve.request import RequestMetrics

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                  "pooling_mode_cls_token": "CLS"}
_ST = "sentence_transformers.models."


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolingParams:
    """vLLM's `PoolingParams` for embeddings, checked when built."""

    use_activation: bool | None = None
    """L2-normalise the embedding (vLLM's name for it); None: the model's default."""
    dimensions: int | None = None
    """Keep the first this many dimensions (a Matryoshka model only), then normalise."""

    def __post_init__(self) -> None:
        if self.use_activation not in (None, True, False):
            raise ValueError(f"use_activation must be True, False or None, got {self.use_activation!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolerConfig:
    """How a model directory's embeddings are made (`from_model_dir`)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None
    """The dimensions a request may ask for: None for a model that is no Matryoshka one, () for
    any up to hidden_size."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PoolerConfig:
        """Read the sentence-transformers files and config.json; a ValueError for what it cannot do
        (another pooling mode, a Dense projection after the pooling)."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        hidden_size = ModelConfig.from_pretrained(model_dir).hidden_size  # a multimodal model's: its text's
        matryoshka = config.get("matryoshka_dimensions")
        dimensions = tuple(matryoshka) if matryoshka else () if config.get("is_matryoshka") else None
        modules_file = model_dir / "modules.json"
        if not modules_file.exists():
            return cls(hidden_size=hidden_size, matryoshka_dimensions=dimensions)
        listed = json.loads(modules_file.read_text())
        modules = {module["type"].removeprefix(_ST): module for module in listed}
        unsupported = sorted(set(modules) - {"Transformer", "Pooling", "Normalize"})
        if unsupported:
            raise ValueError(f"{modules_file} lists modules slipstream does not run: "
                             f"{', '.join(unsupported)}")
        pooling_type = "LAST"
        if "Pooling" in modules:
            pooling = json.loads((model_dir / modules["Pooling"]["path"] / "config.json").read_text())
            chosen = [kind for key, kind in _POOLING_MODES.items() if pooling.get(key)]
            others = sorted(key for key, value in pooling.items() if key.startswith("pooling_mode_")
                            and value and key not in _POOLING_MODES)
            if len(chosen) != 1 or others:
                raise ValueError(f"the Pooling module of {model_dir} asks for {chosen + others}; slipstream "
                                 f"pools one of {', '.join(_POOLING_MODES)}")
            pooling_type = chosen[0]
        return cls(pooling_type=pooling_type, normalize="Normalize" in modules,
                   hidden_size=hidden_size, matryoshka_dimensions=dimensions)

    def check(self, params: PoolingParams) -> None:
        """A ValueError for params this model cannot honour."""
        if params.dimensions is None or params.dimensions == self.hidden_size:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError(f"dimensions={params.dimensions}: this model is no Matryoshka model (its "
                             f"config.json sets neither is_matryoshka nor matryoshka_dimensions)")
        allowed = self.matryoshka_dimensions or range(1, self.hidden_size + 1)
        if params.dimensions not in allowed:
            raise ValueError(f"dimensions={params.dimensions} is not one this model has: "
                             f"{list(allowed) if self.matryoshka_dimensions else f'1 to {self.hidden_size}'}")

    def embedding(self, pooled: torch.Tensor, params: PoolingParams) -> list[float]:
        """A pooled hidden state (E,) as the embedding the params ask for."""
        vector = pooled.float()
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.normalize if params.use_activation is None else params.use_activation:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()


class Pool:
    """One prompt's pooling as its chunks are computed: `add` each chunk's hidden rows in order,
    `result()` once the last one is in. A chunk from position 0 starts over (a preempted prompt
    is computed again)."""

    def __init__(self, pooling_type: str) -> None:
        assert pooling_type in POOLING_TYPES, pooling_type
        self.pooling_type = pooling_type
        self._value: torch.Tensor | None = None
        self._num_rows = 0

    def add(self, rows: torch.Tensor, start: int) -> None:  # rows: (num_tokens, E)
        if start == 0:
            self._value, self._num_rows = None, 0
        if self.pooling_type == "LAST":
            self._value = rows[-1].clone()  # not a view, which would keep the step's whole output
        elif self.pooling_type == "CLS":
            if start == 0:
                self._value = rows[0].clone()
        else:
            total = rows.float().sum(0)
            self._value = total if self._value is None else self._value + total
            self._num_rows += rows.shape[0]

    def result(self) -> torch.Tensor:  # (E,)
        assert self._value is not None, "no rows were added"
        return self._value / self._num_rows if self.pooling_type == "MEAN" else self._value


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's: the embedding of one prompt, with its ids and timings."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = True
    finish_reason: str = "stop"
    """"abort" for a request aborted before its embedding (which is then empty), "error" where a
    server's engine failed while running it."""


@dataclasses.dataclass(slots=True)
class PoolingJob:
    """A pooling engine's request: its prompt, params and pooling so far."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    pool: Pool
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    def output(self, pooler: PoolerConfig, now: float) -> EmbeddingRequestOutput:
        """The request's embedding, its prompt pooled whole."""
        self.metrics.first_token_time_s = self.metrics.finished_time_s = now
        return self._output(pooler.embedding(self.pool.result(), self.params), "stop")

    def aborted(self, now: float, reason: str = "abort") -> EmbeddingRequestOutput:
        """The output of the request stopped before its embedding: empty, with the reason given
        ("abort", or "error" where the engine failed)."""
        self.metrics.finished_time_s = now
        return self._output([], reason)

    def _output(self, embedding: list[float], finish_reason: str) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(request_id=self.request_id, outputs=EmbeddingOutput(embedding),
                                      prompt_token_ids=self.prompt_token_ids, metrics=self.metrics,
                                      num_cached_tokens=self.num_cached_tokens, finish_reason=finish_reason)

