"""Beam search, as vLLM runs it: on top of the engine, one token step at a time. Plain Python.

Each step asks the engine, for every running beam, for the log-probabilities of the
2 x `beam_width` most likely next tokens (a one-token request whose prompt is the beam; prefix
caching keeps the shared part of the beams computed). Every beam plus one of its candidates is a
new candidate beam; those ending in an end-of-sequence token are complete (unless `ignore_eos`),
the best `beam_width` of the rest run on. After `max_tokens` steps the best `beam_width` of the
complete and the running beams are the result, best first.

A beam's score is its cumulative log-probability divided by (generated tokens) **
`length_penalty`, the end-of-sequence token counted, as in transformers' beam search; vLLM's
divides by the prompt's length plus the generated one's, which for a long prompt makes
`length_penalty` all but void. Where no beam ends early the two agree, and the result equals
transformers' `generate(num_beams=beam_width)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

from slipstream.serve.request import MAX_TEMPERATURE, PositionLogprobs, RequestOutput, SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, checked when built. The fields vLLM's has up to
    `include_stop_str_in_output` may be given by position, in its order; the rest by keyword
    (vLLM's `structured_outputs` comes next, which beam search here does not take)."""

    beam_width: int
    """Beams kept per step, and sequences returned."""
    max_tokens: int
    """Most tokens a beam generates (fewer where the context ends first)."""
    ignore_eos: bool = False
    """An end-of-sequence token is a token like any other: no beam completes early."""
    temperature: float = 0.0
    """Changes no beam: beams are ranked by the model's own log-probabilities. In vLLM it is the
    temperature of the token each step samples, which the search does not use (its logprobs are
    those of the raw logits); that token joins the candidates only when it is not among the step's
    2 x beam_width most likely, where it never outranks them (save as an end-of-sequence token
    completing a beam), so at temperature 0 the two searches are the same."""
    length_penalty: float = 1.0
    """Exponent of the generated length the score divides by: above 0 favours longer beams."""
    include_stop_str_in_output: bool = False
    """Accepted for vLLM's sake; beam search takes no stop strings, so there is none to include."""
    _: dataclasses.KW_ONLY
    skip_special_tokens: bool = True
    """Leave special tokens out of the results' `text` (vLLM's default)."""

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        if (isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float))
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    @property
    def num_logprobs(self) -> int:
        """Candidates asked for per beam and step: enough that `beam_width` survive even if all
        the best end the sequence (vLLM's and transformers' 2 x beam_width)."""
        return 2 * self.beam_width


@dataclasses.dataclass(kw_only=True, slots=True)
class BeamSearchSequence:
    """One beam: vLLM's `BeamSearchSequence`."""

    tokens: list[int]
    """The prompt's ids, then the generated ones."""
    logprobs: list[PositionLogprobs]
    """Per generated token, its log-probability and those of the other candidates of that step."""
    cum_logprob: float = 0.0
    text: str | None = None
    """Set on the results: the decoded tokens, prompt included (as in vLLM), special tokens
    skipped unless `BeamSearchParams.skip_special_tokens` is False."""
    finish_reason: str | None = None
    """"stop" (it ended with an end-of-sequence token) or "length", as vLLM's server gives its
    beams' (its offline `beam_search` leaves the field None)."""
    stop_reason: int | None = None
    """The end-of-sequence id that completed it."""


@dataclasses.dataclass(slots=True)
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The search for one prompt: `running` beams to extend, `step` to extend them, `best()`
    once `done`."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self._eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.running = [BeamSearchSequence(tokens=list(prompt_token_ids), logprobs=[])]
        self.completed: list[BeamSearchSequence] = []
        self._steps_left = min(params.max_tokens, max_model_len - self.num_prompt_tokens)

    @property
    def done(self) -> bool:
        return self._steps_left <= 0 or not self.running

    def rank(self, beam: BeamSearchSequence) -> float:
        """A key that orders beams as their scores (cum_logprob / generated ** length_penalty,
        higher is better) do, computed from the score's logarithm: the power itself overflows a
        float for a large length_penalty. Log-probabilities are at most 0, so a higher score has a
        lower log(-score)."""
        if beam.cum_logprob == 0:
            return math.inf
        generated = len(beam.tokens) - self.num_prompt_tokens
        return self.params.length_penalty * math.log(generated) - math.log(-beam.cum_logprob)

    def step(self, candidates: Sequence[PositionLogprobs]) -> None:
        """Extend each running beam by each of its candidates (the engine's logprobs of its next
        position, in the order of `running`)."""
        extended = []
        for beam, position in zip(self.running, candidates, strict=True):
            for token_id, logprob in position.items():
                child = BeamSearchSequence(tokens=[*beam.tokens, token_id],
                                           logprobs=[*beam.logprobs, position],
                                           cum_logprob=beam.cum_logprob + logprob.logprob)
                if token_id in self._eos_token_ids:
                    child.finish_reason, child.stop_reason = "stop", token_id
                    self.completed.append(child)
                else:
                    extended.append(child)
        self.running = sorted(extended, key=self.rank, reverse=True)[: self.params.beam_width]
        self._steps_left -= 1
        if self._steps_left <= 0:
            for beam in self.running:
                beam.finish_reason = "length"

    def best(self) -> list[BeamSearchSequence]:
        """The best `beam_width` beams, complete or not, best first."""
        beams = sorted([*self.completed, *self.running], key=self.rank, reverse=True)
        return beams[: self.params.beam_width]


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What each step asks of the engine for a beam: one token and the logprobs of the candidates
    (the token itself is not used)."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=params.num_logprobs,
                          skip_special_tokens=False)


def next_requests(searches: Sequence[BeamSearch]) -> list[list[int]]:
    """The prompts of the next step: every running beam of every search not done, in order (none
    once all are done)."""
    return [beam.tokens for search in searches if not search.done for beam in search.running]


def advance(searches: Sequence[BeamSearch], outputs: Sequence[RequestOutput]) -> None:
    """Step every search not done by the engine's outputs for `next_requests(searches)`."""
    candidates = iter(output.outputs[0].logprobs[0] for output in outputs)
    for search in [search for search in searches if not search.done]:
        search.step([next(candidates) for _ in search.running])
