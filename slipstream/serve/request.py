"""Requests, sampling parameters and outputs of the serving engine. Plain Python, no torch.

`SamplingParams` mirrors vLLM's (same names, same meanings, mutable as vLLM's) and is validated
when built and again by `clone()`, the copy the engine takes of a request's, so a bad value is a
`ValueError` naming the parameter before anything is queued. `Request` is the engine's mutable
record of one sequence being generated; `RequestOutput` / `CompletionOutput` are what
`LLM.generate` returns, shaped like vLLM's.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slipstream.serve.reasoning_parsers import ReasoningGate
from slipstream.serve.structured import GrammarGuide, Guide, StructuredOutputsParams

FINISH_REASONS = ("stop", "length", "abort")
GREEDY_TEMPERATURE = 1e-5


# vLLM takes any positive repetition penalty; the sampler applies it in float32, where one above
# ~3.4e38 becomes inf (0 * inf: NaN logits, which argmax then picks) and one below ~1e-45 becomes 0
# (0 / 0). Within these bounds a penalised logit stays finite for any logit below 1e32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6

# vLLM 0.32 refuses temperatures above 2, older vLLM took any finite one, so scripts may pass more
# than 2. The sampler divides logits by the temperature in float32, where one above ~3.4e38 is inf
# and a masked -inf logit becomes NaN (-inf / inf), which then wins the draw. At 1e4, logits 10
# apart (odds of e^10 at temperature 1) end up 1e-3 apart: the draw is already uniform over the
# kept tokens to within 0.1%, so a higher bound would add nothing but the risk.
MAX_TEMPERATURE = 1e4
MAX_N = 4096
"""Most completions of one prompt: each is a request of its own, built at once (a huge n would
spend minutes and gigabytes before the first step)."""

# A float32 logit overflows to inf past ~3.4e38, and an inf logit makes softmax NaN. A bias of at most
# 1e25, divided by the smallest repetition penalty (1e-6) and then by the smallest sampling
# temperature (1e-5), stays below 1e37. (The OpenAI layer clamps to [-100, 100], as vLLM's does.)
MAX_LOGIT_BIAS = 1e25


class RequestOutputKind(enum.Enum):
    """vLLM's `SamplingParams.output_kind`: which outputs a streamed request yields. `LLM` returns
    each request's final output whatever the kind (vLLM's `LLM` sets FINAL_ONLY); the engine streams
    as its `add_request(stream=...)` says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one prompt's completions. Defaults follow vLLM.

    Mutable, as vLLM's (`sp = llm.get_default_sampling_params(); sp.max_tokens = 8`): a value set
    after construction is checked by `clone()`, which `Engine.add_request` calls (as vLLM's engine
    clones), so the engine neither runs an unchecked value nor sees a later change."""

    n: int = 1
    """Number of completions to generate for the prompt."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appeared in the output."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of the token in the output."""
    seed: int | None = None
    """Seed of this request's own random generator, for reproducible sampling; -1 means none (as
    in vLLM)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    min_tokens: int = 0
    """End-of-sequence and stop tokens are suppressed until this many tokens are generated."""
    stop: tuple[str, ...] = ()
    """Strings that end generation when they appear in the output text (not included in it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to the model's end-of-sequence ids)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (for benchmarks)."""
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log-probabilities of the sampled token and of the `logprobs` most likely; True
    means 1 and -1 the whole vocabulary (as in vLLM)."""
    prompt_logprobs: int | None = None
    """Return log-probabilities for every prompt token, with the `prompt_logprobs` most likely;
    True means 1 and -1 the whole vocabulary (as in vLLM)."""
    detokenize: bool = True
    """False: outputs carry token ids without text (`text` "", no logprob's `decoded_token`), as in
    vLLM, which then takes no stop strings. `LLM` honours it; the engine itself still decodes, so
    its own outputs (to the HTTP server or a direct caller) keep their text."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """vLLM's switch for decoders that put a space before a special token following another one
    (WordPiece's). The decoders of the families slipstream serves (byte-level BPE, SentencePiece's
    Metaspace) never do, so both values give the same text, as they do in vLLM for these models."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """See `RequestOutputKind`."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before penalties and sampling (as in vLLM)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Sample only among these token ids (as in vLLM); None allows every token."""
    bad_words: tuple[str, ...] = ()
    """Words never to generate (as in vLLM): the engine tokenizes each as it would begin the text
    and as it would follow a space, and masks a word's last token whenever the output ends with
    the rest of it."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (as vLLM's): `StructuredOutputsParams(choice=[...])` makes it exactly one
    of the strings, `StructuredOutputsParams(regex=...)` a match of the regular expression."""
    truncate_prompt_tokens: int | None = None
    """Generate from only the last k prompt tokens (left truncation, as in vLLM; a text prompt
    keeps the special tokens its tokenizer adds); -1 means the model's context length."""
    extra_args: dict[str, Any] | None = None
    """Arbitrary values for custom sampling code, carried along and not used by slipstream (as by
    no sampler in vLLM's tree)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # NumPy (or other) scalars as Python numbers
            value = getattr(self, field.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, int):
                object.__setattr__(self, field.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
                object.__setattr__(self, field.name, float(value))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        bad_words = self.bad_words or ()
        if not isinstance(bad_words, (list, tuple)) or any(
                not isinstance(word, str) or not word.strip() for word in bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(bad_words))
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            allowed = tuple(self.allowed_token_ids)
            for token_id in allowed:
                _check_int("allowed_token_ids", token_id, minimum=0)
            # Each distinct id once: the sampler turns them into a mask at every step.
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(allowed)))
        if isinstance(self.seed, int) and self.seed == -1:
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's shorthand for one
                object.__setattr__(self, name, 1)
            elif getattr(self, name) is False:  # vLLM would read 0: the sampled token's logprob
                raise ValueError(f"{name} must be an integer or None (None for no logprobs), got False")
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        _check_float("temperature", self.temperature, minimum=0.0)
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{self.structured_outputs!r}")
            for name, conflict in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens),
                                   ("allowed_token_ids", self.allowed_token_ids)):
                if conflict:
                    raise ValueError(f"{name} cannot be used with structured_outputs, which ends the "
                                     "output with an end-of-sequence token where it matches")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for the context length, got 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=-1)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):  # a string such as "false" is truthy
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"detokenize=False cannot be used with stop={list(self.stop)!r}: stop strings "
                             "are matched in the text")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures this small are a point mass on the argmax anyway (vLLM's cutoff)."""
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A deep copy, checked again (as on construction): vLLM's `clone`, and what the engine
        gets, so that changing this object later changes no request already made with it."""
        params = copy.deepcopy(self)
        params.__post_init__()
        return params


GENERATION_CONFIG_SAMPLING_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens",
}
"""The generation_config.json keys that vLLM's generation_config="auto" (its default) turns into
default sampling parameters, under their SamplingParams names."""


def generation_config_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults a model directory's generation_config.json sets (none without the
    file), by SamplingParams name: what the offline API and the server use for what a request
    leaves unset."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {name: config[key] for key, name in GENERATION_CONFIG_SAMPLING_KEYS.items()
            if config.get(key) is not None}


def bad_words_token_ids(
    bad_words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int,
) -> tuple[tuple[int, ...], ...]:
    """The token id sequences that spell `bad_words`, as vLLM derives them: each word (leading spaces
    stripped) encoded as is, and after a space when that changes its first token but not its length.
    `encode` tokenizes without special tokens. Sequences with ids outside the vocabulary, which the
    model cannot generate, are left out."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in bad_words:
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        sequences[bare] = None
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences[spaced] = None
    return tuple(ids for ids in sequences if ids and all(0 <= t < vocab_size for t in ids))


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop` as a tuple: None, one string, or a list or tuple of strings (not any iterable: a
    dict's keys or a set's arbitrary order are surely a mistake)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(stop)


def _logit_bias(logit_bias: Any) -> dict[int, float] | None:
    """A copy of `logit_bias` ({token id: finite bias}); None or {} means no bias."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {logit_bias!r}")
    for token_id, bias in logit_bias.items():
        _check_int("logit_bias", token_id, minimum=0)
        _check_float("logit_bias", bias)
        if abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {bias} for token {token_id}")
    return dict(logit_bias) or None


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: Any, *, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens, prompt positions [offset, offset + length),
    whose input embeddings are the image's, and what the image encoder computes them from."""

    offset: int
    length: int
    content_hash: str
    """Of the preprocessed pixels: in the prefix-cache key of every block holding a placeholder."""
    pixel_values: Any
    """The image as the processor made it: a (3, H, W) float32 tensor."""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence the engine generates: the prompt, what was generated so far, and progress.

    The tokens the model owes this request are `all_token_ids`; `num_computed_tokens` of them have
    their keys and values in the KV cache. A request with `n > 1` completions is served as `n`
    requests sharing the prompt (and, through prefix caching, its KV blocks).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """`sampling_params.bad_words` as token id sequences (`bad_words_token_ids`)."""
    guide: Guide | GrammarGuide | None = None
    """`sampling_params.structured_outputs` as the engine enforces it; `guide_state` is where the
    output has reached."""
    guide_state: Any = None
    reasoning_gate: ReasoningGate | None = None
    """While set, the reply is still reasoning and the guide waits (`EngineConfig.reasoning_parser`):
    the gate finds where the answer begins, from which the guide constrains it."""
    max_total_tokens: int = 2**62
    """Prompt plus output may not exceed this (the model's context length)."""
    arrival_time_s: float = 0.0
    priority: int = 0
    """Lower values are served first under the priority policy, and preempted last."""
    lora_id: int = 0
    """The LoRA adapter it runs under, as the engine loaded it (0: none, the base model). The
    engine never gives one id to two adapters, so an id also names the adapter's prefix-cache
    blocks."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, in prompt order (a multimodal model's)."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was (last) admitted."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def images_end(self) -> int:
        """The position past the last image's placeholders (0 without images): a chunk that starts
        before it may need image embeddings."""
        return self.images[-1].end if self.images else 0

    def image_hashes(self, start: int, stop: int) -> tuple[str, ...]:
        """The content hashes of the images with a placeholder in positions [start, stop)."""
        return tuple(image.content_hash for image in self.images if image.offset < stop and start < image.end)

    @property
    def max_output_tokens(self) -> int:
        """Output tokens allowed: max_tokens, capped by the context length."""
        room = self.max_total_tokens - self.num_prompt_tokens
        if self.sampling_params.max_tokens is None:
            return room
        return min(self.sampling_params.max_tokens, room)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclasses.dataclass(kw_only=True, slots=True)
class Logprob:
    """A token's log-probability and its rank among the vocabulary (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None
    token_bytes: bytes | None = None
    """The token's own bytes, which differ from decoded_token's UTF-8 for a token that holds part
    of a multi-byte character (its text is U+FFFD)."""


# Per position: token id -> Logprob, holding the chosen token and the top-n alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass(kw_only=True)
class CompletionOutput:
    """One of the `n` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """"stop" (end-of-sequence, stop token or stop string), "length", "abort", or "error" where a
    server's engine failed while running it."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, if any."""
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether it is complete: a method, as vLLM's `CompletionOutput.finished()` (where
        `RequestOutput.finished` is an attribute, as there)."""
        return self.finish_reason is not None


@dataclasses.dataclass(kw_only=True)
class RequestMetrics:
    """Per-request timings (seconds on the engine's monotonic clock)."""

    arrival_time_s: float
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time_s is None:
            return None
        return self.first_scheduled_time_s - self.arrival_time_s

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.arrival_time_s

    @property
    def e2e_latency_s(self) -> float | None:
        if self.finished_time_s is None:
            return None
        return self.finished_time_s - self.arrival_time_s


@dataclasses.dataclass(kw_only=True)
class RequestOutput:
    """Everything generated for one prompt so far (complete when `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0


def validate_prompt_token_ids(
    token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, generates: bool = True
) -> list[int]:
    """The prompt as a list of ints, or a ValueError saying what is wrong with it. A prompt to
    generate from must leave room for one token; one to embed (generates=False) may fill the
    context."""
    if len(token_ids) == 0:
        raise ValueError("prompt must not be empty")
    ids = list(token_ids)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"prompt token ids must be integers, got {token_id!r} "
                             f"({type(token_id).__name__})")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"prompt token id {token_id!r} is not in [0, {vocab_size})")
    if len(ids) > max_model_len - generates:
        room = " (the prompt must leave room for at least one generated token)" if generates else ""
        raise ValueError(f"prompt has {len(ids)} tokens, but the model's context length is "
                         f"{max_model_len}{room}")
    return ids
