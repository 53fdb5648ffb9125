"""Batched token sampling: penalties, min_tokens, greedy / temperature / top-k / top-p / min-p, logprobs.

The engine builds one `SamplingBatch` per step from the sequences that sample in it (`SamplingRow`s);
`sample` then chooses one token per row, vectorised over the batch. Order and meanings follow vLLM
(see `slipstream.serve.request.SamplingParams`):

1. logprobs, when any row asks for them, come from the raw logits (log_softmax before anything below);
2. allowed_token_ids (or a structured output's tokens of this step) masks every other token; bad
   words mask the token that would complete one;
3. min_tokens masks end-of-sequence and stop token ids while the output is shorter;
4. logit_bias is added;
5. repetition penalty over prompt and output tokens, then frequency and presence over output tokens;
6. greedy rows take the argmax; the others are divided by their temperature, filtered by min-p, then
   top-k and top-p (over the survivors of both), and sampled by an exponential race, argmax(probs / Exp(1)),
   a seeded row drawing its noise from its own generator so its tokens do not depend on the batch.

Every filter is a per-row threshold ("keep the tokens whose logit is >= t"), so tokens tied with the
last one kept are all kept; top-k and top-p combine into one `masked_fill`.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from slipstream.ops import cpu_kernels
from slipstream.serve.request import GREEDY_TEMPERATURE, Logprob, PositionLogprobs, SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator of a request with `SamplingParams.seed`. Create it once per request and pass it
    in every step's `SamplingRow`, so each step's draws continue where the last step's stopped.

    The CPU generator (mt19937) keeps only a seed's low 32 bits, so seeds outside [0, 2**32) are
    first mixed down to 32 bits: seeds 2**32 apart would otherwise draw the same tokens."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if 0 <= seed < 2**32 else _fold_to_32_bits(seed))
    return generator


def _fold_to_32_bits(seed: int) -> int:
    """SplitMix64's finaliser (Steele et al., OOPSLA 2014) of the seed's 64 bits, halves xored."""
    mask = 2**64 - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z ^ (z >> 32)) & (2**32 - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingRow:
    """One sequence that samples a token this step, as the engine describes it to `SamplingBatch.build`.

    The token lists are held by reference (pass the request's own lists; nothing is copied). Their
    contents are read only for penalties, and not at all when the row has a `counts_slot`.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    """`params.bad_words` as token id sequences (`request.bad_words_token_ids`)."""
    generator: torch.Generator | None = None
    """The request's own generator (`make_generator`); required when `params.seed` is set."""
    allowed_token_ids: Sequence[int] | np.ndarray | None = None
    """This step's allowed tokens under `params.structured_outputs` (the engine's guide: an int64
    `array.array`, read without a copy, or a numpy bool mask over the vocabulary, True where
    allowed), used as `params.allowed_token_ids` is."""
    counts_slot: int | None = None
    """The request's slot in the `TokenCounts` given to `build`, which then replaces counting lists."""


class TokenCounts:
    """Token counts of running requests, kept by the engine across steps so that penalties cost
    O(rows x vocab) per step instead of re-counting every generated token.

    Life of a slot: `reset` when a request with penalties is admitted (or resumed after preemption),
    `SamplingRow(counts_slot=slot)` every step, `record(batch, output.token_ids)` after `sample`.
    Memory: num_slots x vocab x 5 bytes.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str) -> None:
        self.output_counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)

    def reset(self, slot: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()):
        """Start counting a request in `slot` from its prompt and whatever it has generated so far."""
        device = self.output_counts.device
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
        outputs = torch.tensor(list(output_token_ids), dtype=torch.long, device=device)  # (num_output,)
        self.output_counts[slot].zero_().index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    def record(self, batch: SamplingBatch, token_ids: torch.Tensor) -> None:
        """Count the tokens `sample` chose (`token_ids`, (num_rows,)) for the batch's rows with a slot."""
        if batch.slot_rows is None:
            return
        chosen = token_ids[batch.slot_rows]  # (num_slot_rows,)
        ones = torch.ones_like(chosen, dtype=torch.int32)
        self.output_counts.index_put_((batch.slots, chosen), ones, accumulate=True)


# ---------------------------------------------------------------------------------------------------
# top-k / top-p / min-p


@dataclasses.dataclass(frozen=True, slots=True)
class LogitFilters:
    """Per-row top-k, top-p and min-p. A field is None when no row uses that filter, so an unused
    filter costs nothing (top-p is the expensive one: it sorts the vocabulary)."""

    top_k: torch.Tensor | None  # (num_rows,) long in [1, vocab]; vocab where the row keeps all
    max_top_k: int
    top_p: torch.Tensor | None  # (num_top_p_rows,) float32 in (0, 1): only the rows with top_p < 1
    top_p_rows: torch.Tensor | None  # (num_top_p_rows,) long; None when every row has top_p < 1
    log_min_p: torch.Tensor | None  # (num_rows,) float32; -inf where the row has no min-p

    @classmethod
    def build(
        cls, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float], *,
        vocab_size: int, device: torch.device | str,
    ) -> LogitFilters | None:
        """Filters from per-row `SamplingParams` values (top_k 0 or -1 is off; a top_k above the
        vocabulary keeps all). None when no row filters anything."""
        top_k = [vocab_size if k <= 0 else min(k, vocab_size) for k in top_k]
        max_top_k = max((k for k in top_k if k < vocab_size), default=0)
        top_p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
        any_min_p = any(m > 0.0 for m in min_p)
        if not (max_top_k or top_p_rows or any_min_p):
            return None
        return cls(
            top_k=torch.tensor(top_k, dtype=torch.long, device=device) if max_top_k else None,
            max_top_k=max_top_k,
            top_p=torch.tensor([top_p[i] for i in top_p_rows], dtype=torch.float32, device=device)
            if top_p_rows else None,
            top_p_rows=None if len(top_p_rows) in (0, len(top_p))
            else torch.tensor(top_p_rows, device=device),
            log_min_p=torch.tensor([math.log(m) if m > 0 else -math.inf for m in min_p],
                                   dtype=torch.float32, device=device) if any_min_p else None,
        )


def filter_logits(logits: torch.Tensor, filters: LogitFilters) -> torch.Tensor:
    """`logits` (num_rows, vocab) with the tokens that min-p, then top-k and top-p drop set to -inf (a
    new tensor), in the order of vLLM's v1 sampler. Min-p drops tokens below min_p x the top
    probability; top-p keeps the smallest set of most likely tokens whose probability, renormalised
    over the survivors of min-p and top-k, sums to >= top_p."""
    if filters.log_min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= max logit + log(min_p)
        min_p = logits.amax(-1) + filters.log_min_p  # (num_rows,)
        logits = logits.masked_fill(logits < min_p[:, None], -math.inf)
    thresholds = []  # each (num_rows,): keep logits >= threshold
    if filters.top_k is not None:
        thresholds.append(_top_k_threshold(logits, filters.top_k, filters.max_top_k))
    if filters.top_p is not None:
        thresholds.append(_top_p_threshold(logits, filters))
    if not thresholds:
        return logits
    threshold = functools.reduce(torch.maximum, thresholds)  # (num_rows,)
    return logits.masked_fill(logits < threshold[:, None], -math.inf)


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    top = logits.topk(max_top_k, dim=-1).values  # (num_rows, max_top_k), descending
    kth = top.gather(1, top_k.clamp(max=max_top_k)[:, None] - 1).squeeze(1)  # (num_rows,)
    return torch.where(top_k <= max_top_k, kth, -math.inf)


def _top_p_threshold(logits: torch.Tensor, filters: LogitFilters) -> torch.Tensor:
    """Per row, the top-p threshold (over the top-k survivors); -inf for rows without top-p, which
    are not sorted."""
    rows = filters.top_p_rows
    if rows is None:
        return _top_k_top_p_threshold(logits, filters.top_k, filters.top_p)
    top_k = None if filters.top_k is None else filters.top_k[rows]  # (num_top_p_rows,)
    threshold = _top_k_top_p_threshold(logits[rows], top_k, filters.top_p)  # (num_top_p_rows,)
    return logits.new_full(logits.shape[:1], -math.inf).index_copy_(0, rows, threshold)


def _top_k_top_p_threshold(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """The top-p threshold over the top-k survivors (-inf where it falls past them), for rows that all
    have top_p < 1 (at top_p = 1 float sums may reach 1 before the last token and drop it)."""
    vocab_size = logits.shape[-1]
    ordered = logits.sort(dim=-1, descending=True).values  # (num_rows, vocab)
    if top_k is not None:
        kth = ordered.gather(1, top_k[:, None] - 1)  # (num_rows, 1)
        ordered.masked_fill_(ordered < kth, -math.inf)
    cumulative = ordered.softmax(-1).cumsum_(-1)  # (num_rows, vocab), non-decreasing
    # Token i is kept when the tokens before it hold < top_p: that is the ones whose cumulative sum
    # is below top_p, plus the one that crosses it.
    num_keep = ((cumulative < top_p[:, None]).sum(-1) + 1).clamp_(max=vocab_size)  # (num_rows,)
    return ordered.gather(1, num_keep[:, None] - 1).squeeze(1)  # (num_rows,)


# ---------------------------------------------------------------------------------------------------
# penalties and min_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Penalties:
    """Per-row penalties and the token counts they act on (rows without penalties hold neutral values
    and are not counted)."""

    repetition: torch.Tensor  # (num_rows,) float32; 1 = off
    presence: torch.Tensor  # (num_rows,) float32
    frequency: torch.Tensor  # (num_rows,) float32
    output_counts: torch.Tensor  # (num_rows, vocab) int32: occurrences of each token in the output
    seen: torch.Tensor | None  # (num_rows, vocab) bool: in prompt or output; None if no repetition


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """`logits` (num_rows, vocab) penalised as vLLM does (a new tensor): logits of seen tokens are
    divided by the repetition penalty when positive and multiplied by it otherwise, then
    logit -= frequency * count + presence * (count > 0)."""
    # clamp and addcmul rather than torch.where and bool masks: same values, several times faster on CPU.
    if penalties.seen is not None:
        factor = torch.where(penalties.seen, penalties.repetition[:, None], 1.0)  # (num_rows, vocab)
        logits = logits.clamp(min=0) / factor + logits.clamp(max=0) * factor
    counts = penalties.output_counts.to(logits.dtype)  # (num_rows, vocab)
    logits = torch.addcmul(logits, counts, penalties.frequency[:, None], value=-1)
    return torch.addcmul(logits, counts.clamp_(max=1), penalties.presence[:, None], value=-1)


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _flat_token_index(rows: list[int], token_lists: list[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Indices into a flattened (num_rows, vocab) tensor of every (row, token) pair, built by numpy in
    one pass over the tokens (no Python object per token)."""
    lengths = [len(tokens) for tokens in token_lists]
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=sum(lengths))
    return torch.from_numpy(tokens + np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, lengths))


def _build_penalties(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device, token_counts: TokenCounts | None
) -> Penalties | None:
    active = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not active:
        return None
    any_repetition = any(rows[i].params.repetition_penalty != 1.0 for i in active)
    slotted = [i for i in active if rows[i].counts_slot is not None]
    if slotted and token_counts is None:
        raise ValueError("rows have a counts_slot but SamplingBatch.build got no token_counts")
    if all(row.counts_slot is not None for row in rows):  # the engine counts: a gather, no counting
        slots = torch.tensor([row.counts_slot for row in rows], device=device)  # (num_rows,)
        counts = token_counts.output_counts[slots]  # (num_rows, vocab)
        seen = token_counts.prompt_mask[slots] if any_repetition else None  # (num_rows, vocab)
    else:
        counts, seen = _count_tokens(rows, active, slotted, any_repetition, vocab_size, device, token_counts)
    if seen is not None:
        seen |= counts > 0
    values = torch.tensor([[r.params.repetition_penalty, r.params.presence_penalty,
                            r.params.frequency_penalty] for r in rows], dtype=torch.float32)
    repetition, presence, frequency = values.to(device).T  # each (num_rows,)
    return Penalties(repetition=repetition, presence=presence, frequency=frequency,
                     output_counts=counts, seen=seen)


def _count_tokens(rows, active, slotted, any_repetition, vocab_size, device, token_counts):
    """Output counts (num_rows, vocab) int32 and prompt mask (or None) of the `active` rows: from the
    engine's `token_counts` for the `slotted` ones, by counting their token lists for the others."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device) if any_repetition else None
    listed = [i for i in active if rows[i].counts_slot is None]
    if listed:
        index = _flat_token_index(listed, [rows[i].output_token_ids for i in listed], vocab_size).to(device)
        counts.view(-1).index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
        if seen is not None:
            prompts = [rows[i].prompt_token_ids for i in listed]
            seen.view(-1)[_flat_token_index(listed, prompts, vocab_size).to(device)] = True
    if slotted:
        index = torch.tensor(slotted, device=device)  # (num_slotted,)
        slots = torch.tensor([rows[i].counts_slot for i in slotted], device=device)
        counts[index] = token_counts.output_counts[slots]
        if seen is not None:
            seen[index] = token_counts.prompt_mask[slots]
    return counts, seen


def _build_min_tokens(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device):
    """(row ids, token ids) to mask to -inf: end-of-sequence and stop ids of the rows still short of
    min_tokens (end-of-sequence under ignore_eos too, as vLLM masks them)."""
    pairs = [(i, token_id) for i, row in enumerate(rows)
             if len(row.output_token_ids) < row.params.min_tokens
             for token_id in (*row.eos_token_ids, *row.params.stop_token_ids) if 0 <= token_id < vocab_size]
    return _row_token_pairs(pairs, device)


def _row_token_pairs(pairs: list[tuple[int, int]], device: torch.device):
    """(row ids, token ids) tensors of (row, token) pairs, each (num_pairs,); None for no pairs."""
    if not pairs:
        return None
    row_ids, token_ids = torch.tensor(pairs, dtype=torch.long).to(device).T
    return row_ids, token_ids


def _build_allowed(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device):
    """(row ids, mask) for the rows with allowed_token_ids: mask (num_those_rows, vocab) is True at the
    tokens to mask to -inf, every token outside the row's set."""
    allowed = [row.params.allowed_token_ids if row.allowed_token_ids is None else row.allowed_token_ids
               for row in rows]
    ids = [i for i, tokens in enumerate(allowed) if tokens is not None]
    if not ids:
        return None
    mask = torch.ones(len(ids), vocab_size, dtype=torch.bool)
    for j, i in enumerate(ids):
        tokens = allowed[i]
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.bool_:
            torch.logical_not(torch.from_numpy(tokens), out=mask[j])
            continue
        mask[j, torch.frombuffer(tokens, dtype=torch.int64) if isinstance(tokens, array.array)
             else torch.tensor(tokens, dtype=torch.int64)] = False
    return torch.tensor(ids, device=device), mask.to(device)


def _build_bad_words(rows: Sequence[SamplingRow], device: torch.device):
    """(row ids, token ids) to mask to -inf: the last token of each bad word whose other tokens end
    the row's output (a one-token word always)."""
    pairs = [(i, word[-1]) for i, row in enumerate(rows) for word in row.bad_words_token_ids
             if _ends_with(row.output_token_ids, word[:-1])]
    return _row_token_pairs(pairs, device)


def _ends_with(tokens: Sequence[int], suffix: Sequence[int]) -> bool:
    start = len(tokens) - len(suffix)
    return start >= 0 and tuple(tokens[start:]) == tuple(suffix)


def _build_logit_bias(rows: Sequence[SamplingRow], device: torch.device):
    """(row ids, token ids, biases) to add to the logits."""
    triples = [(i, token_id, bias) for i, row in enumerate(rows) if row.params.logit_bias
               for token_id, bias in row.params.logit_bias.items()]
    if not triples:
        return None
    row_ids, token_ids, biases = zip(*triples, strict=True)
    return (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


# ---------------------------------------------------------------------------------------------------
# the batch


@dataclasses.dataclass(frozen=True, slots=True)
class RandomRows:
    """The rows that sample rather than take the argmax, as a sub-batch."""

    index: torch.Tensor | None  # (num_random,) long rows of the batch; None when every row samples
    temperature: torch.Tensor | None  # (num_random,) float32; None when all are 1
    filters: LogitFilters | None
    generators: tuple[tuple[int, torch.Generator], ...]  # (position in sub-batch, generator)
    any_unseeded: bool
    unseeded_generator: torch.Generator | None  # what rows without a generator draw from


def _build_random_rows(
    rows: Sequence[SamplingRow], vocab_size: int, device: torch.device,
    unseeded_generator: torch.Generator | None,
):
    ids = [i for i, row in enumerate(rows) if row.params.temperature >= GREEDY_TEMPERATURE]
    if not ids:
        return None
    params = [rows[i].params for i in ids]
    for i in ids:
        if rows[i].params.seed is not None and rows[i].generator is None:
            raise ValueError(f"row {i} has seed {rows[i].params.seed} but no generator "
                             "(create one per request with make_generator and pass it every step)")
    temperatures = [p.temperature for p in params]
    return RandomRows(
        index=None if len(ids) == len(rows) else torch.tensor(ids, device=device),
        temperature=None if all(t == 1.0 for t in temperatures)
        else torch.tensor(temperatures, dtype=torch.float32, device=device),
        filters=LogitFilters.build([p.top_k for p in params], [p.top_p for p in params],
                                   [p.min_p for p in params], vocab_size=vocab_size, device=device),
        generators=tuple((j, rows[i].generator) for j, i in enumerate(ids)
                         if rows[i].generator is not None),
        any_unseeded=any(rows[i].generator is None for i in ids),
        unseeded_generator=unseeded_generator,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Everything `sample` needs for one step, on the logits' device. Build it with `build`."""

    num_rows: int
    vocab_size: int
    random: RandomRows | None  # None when every row is greedy
    penalties: Penalties | None  # None when no row has a penalty
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (row ids, token ids) to mask
    allowed_mask: tuple[torch.Tensor, torch.Tensor] | None  # (row ids, (rows, vocab) bool: to mask)
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None  # (row ids, token ids) to mask
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row ids, token ids, biases)
    num_logprobs: tuple[int | None, ...]  # per row: SamplingParams.logprobs
    slot_rows: torch.Tensor | None  # (num_slot_rows,) long rows with a counts_slot, for TokenCounts
    slots: torch.Tensor | None  # (num_slot_rows,) long their slots

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], *, vocab_size: int, device: torch.device | str,
        token_counts: TokenCounts | None = None, unseeded_generator: torch.Generator | None = None,
    ) -> SamplingBatch:
        """The batch of `rows`, in order (row i samples from logits[i]). Work no row needs is skipped:
        no counts without penalties, no sort without top-p, only an argmax when all rows are greedy.
        Rows without a generator of their own draw from `unseeded_generator` (the engine's, seeded
        once: `EngineConfig.seed`), or torch's default generator when it is None."""
        device = torch.device(device)
        slotted = [i for i, row in enumerate(rows) if row.counts_slot is not None]
        num_logprobs = tuple(row.params.logprobs for row in rows)
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random=_build_random_rows(rows, vocab_size, device, unseeded_generator),
            penalties=_build_penalties(rows, vocab_size, device, token_counts),
            min_tokens_mask=_build_min_tokens(rows, vocab_size, device),
            allowed_mask=_build_allowed(rows, vocab_size, device),
            bad_words_mask=_build_bad_words(rows, device),
            logit_bias=_build_logit_bias(rows, device),
            num_logprobs=num_logprobs,
            slot_rows=torch.tensor(slotted, device=device) if slotted else None,
            slots=torch.tensor([rows[i].counts_slot for i in slotted], device=device) if slotted else None,
        )

    @property
    def max_num_logprobs(self) -> int | None:
        """Most top logprobs any row asked for; None when no row asked for logprobs."""
        return max((n for n in self.num_logprobs if n is not None), default=None)


# ---------------------------------------------------------------------------------------------------
# sampling and logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """Log-probabilities of one token per row (the sampled or actual next token) and the top ones."""

    token_ids: torch.Tensor  # (num_rows,) long
    token_logprobs: torch.Tensor  # (num_rows,) float32
    token_ranks: torch.Tensor  # (num_rows,) long: tokens at least as likely, itself included (1 = top)
    top_ids: torch.Tensor  # (num_rows, num_top) long, most likely first
    top_logprobs: torch.Tensor  # (num_rows, num_top) float32

    def to_position_logprobs(self, num_top: Sequence[int | None]) -> list[PositionLogprobs | None]:
        """Per row: token id -> Logprob for the row's token and its `num_top[row]` most likely tokens
        (None where num_top is None). One device-to-host copy per tensor."""
        ids, logprobs, ranks = (t.tolist() for t in (self.token_ids, self.token_logprobs, self.token_ranks))
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        positions: list[PositionLogprobs | None] = []
        for row, n in enumerate(num_top):
            if n is None:
                positions.append(None)
                continue
            position = {ids[row]: Logprob(logprob=logprobs[row], rank=ranks[row])}
            top = zip(top_ids[row][:n], top_logprobs[row][:n], strict=True)
            for rank, (token_id, logprob) in enumerate(top, start=1):
                position.setdefault(token_id, Logprob(logprob=logprob, rank=rank))
            positions.append(position)
        return positions


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerOutput:
    """What `sample` chose for one step."""

    token_ids: torch.Tensor  # (num_rows,) long: the chosen token of each row
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs
    num_logprobs: tuple[int | None, ...]

    def position_logprobs(self) -> list[PositionLogprobs | None]:
        """Per row, the `CompletionOutput.logprobs` entry of this step (None for rows not asking)."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        return self.logprobs.to_position_logprobs(self.num_logprobs)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of `logits` (num_rows, vocab), chosen as the module docstring describes, with
    logprobs of the raw distribution for the rows that ask. `logits` is not modified."""
    if logits.shape != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits have shape {tuple(logits.shape)}, "
                         f"the batch expects ({batch.num_rows}, {batch.vocab_size})")
    if batch.random is None and batch.penalties is None and batch.min_tokens_mask is None \
            and batch.allowed_mask is None and batch.bad_words_mask is None and batch.logit_bias is None \
            and batch.max_num_logprobs is None:  # plain greedy: bf16's argmax is that of its fp32 values
        return SamplerOutput(token_ids=argmax(logits), logprobs=None, num_logprobs=batch.num_logprobs)
    logits = logits.float()
    max_num_logprobs = batch.max_num_logprobs
    raw_logprobs = None if max_num_logprobs is None else logits.log_softmax(-1)  # (num_rows, vocab)
    token_ids = _choose(penalised_logits(logits, batch), batch.random)  # (num_rows,)
    logprobs = None if raw_logprobs is None else _logprobs_of(raw_logprobs, token_ids, max_num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, num_logprobs=batch.num_logprobs)


def penalised_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`logits` (num_rows, vocab) after steps 2-5 of the module docstring (allowed tokens, bad words,
    min_tokens, logit bias, penalties): what greedy rows take the argmax of, and random rows divide by
    their temperature. The input itself when none applies."""
    if batch.allowed_mask is not None:
        row_ids, mask = batch.allowed_mask
        logits = logits.index_put((row_ids,), logits[row_ids].masked_fill(mask, -math.inf))
    if batch.bad_words_mask is not None:
        logits = logits.index_put(batch.bad_words_mask, logits.new_full((), -math.inf))
    if batch.min_tokens_mask is not None:
        logits = logits.index_put(batch.min_tokens_mask, logits.new_full((), -math.inf))
    if batch.logit_bias is not None:
        row_ids, token_ids, biases = batch.logit_bias
        logits = logits.index_put((row_ids, token_ids), biases, accumulate=True)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def _choose(logits: torch.Tensor, random: RandomRows | None) -> torch.Tensor:
    if random is None:
        return argmax(logits)
    if random.index is None:
        return _sample_random(logits, random)
    token_ids = argmax(logits)  # (num_rows,) kept for the greedy rows
    return token_ids.index_copy_(0, random.index, _sample_random(logits[random.index], random))


def _sample_random(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    if random.temperature is not None:
        logits = logits / random.temperature[:, None]  # (num_random, vocab)
    if random.filters is not None:
        logits = filter_logits(logits, random.filters)
    probs = logits.softmax(-1)  # (num_random, vocab)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i. -log(U) is
    # Exp(1) and several times cheaper on CPU than exponential_(). U is kept above 0 so that E is
    # finite: an infinite E would zero every kept token of a row with one survivor, and the argmax of
    # all zeros could be a masked token.
    uniform = (torch.rand(probs.shape, generator=random.unseeded_generator, dtype=probs.dtype,
                          device=probs.device) if random.any_unseeded else torch.empty_like(probs))
    for position, generator in random.generators:
        uniform[position].uniform_(generator=generator)  # the row's own stream, whatever the batch
    noise = uniform.clamp_(min=torch.finfo(uniform.dtype).tiny).log_().neg_()  # (num_random, vocab)
    return argmax(probs.div_(noise))


def takes_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether `sample` takes a row's next token as the plain argmax of its logits: greedy, with no
    penalty, no logprobs, no bias, allowed set, bad words or structured output, and min_tokens
    reached (nothing masked). The engine may then run several decode steps of it at once
    (`EngineConfig.num_scheduler_steps`)."""
    return (params.greedy and not _has_penalty(params) and params.logprobs is None
            and params.prompt_logprobs is None and num_output_tokens >= params.min_tokens
            and params.logit_bias is None and params.allowed_token_ids is None and not params.bad_words
            and params.structured_outputs is None)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` of (num_rows, vocab): on the CPU through a C kernel, ~10x faster than torch's."""
    return cpu_kernels.argmax(x) if cpu_kernels.supports(x) else x.argmax(-1)


def _logprobs_of(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    token_logprobs = logprobs.gather(1, token_ids[:, None])  # (num_rows, 1)
    top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # (num_rows, num_top) each
    return LogprobsTensors(
        token_ids=token_ids,
        token_logprobs=token_logprobs.squeeze(1),
        token_ranks=(logprobs >= token_logprobs).sum(-1),
        top_ids=top.indices,
        top_logprobs=top.values,
    )


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int, *, chunk_size: int = 512
) -> LogprobsTensors:
    """Logprobs of the actual next prompt tokens: `logits` (num_positions, vocab) at prompt positions,
    `next_token_ids` (num_positions,) the token each position predicts. Raw distribution, with the
    `num_top` most likely per position; processed `chunk_size` positions at a time to bound memory."""
    if logits.shape[0] != next_token_ids.shape[0]:
        raise ValueError(f"{logits.shape[0]} positions of logits but {next_token_ids.shape[0]} tokens")
    parts = [_logprobs_of(chunk.float().log_softmax(-1), ids, num_top)
             for chunk, ids in zip(logits.split(chunk_size), next_token_ids.split(chunk_size), strict=True)]
    return LogprobsTensors(*(torch.cat([getattr(p, f.name) for p in parts])
                             for f in dataclasses.fields(LogprobsTensors)))
