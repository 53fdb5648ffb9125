"""The batched sampler against plain reference implementations written with loops over a small vocabulary."""

from __future__ import annotations

import array
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.serve.request import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from slipstream.serve.sampler import (
    LogitFilters,
    SamplingBatch,
    SamplingRow,
    TokenCounts,
    filter_logits,
    make_generator,
    penalised_logits,
    prompt_logprobs,
    sample,
    takes_argmax,
)

# A token within this distance of a top-p or min-p boundary may be kept or dropped: the sampler works
# in float32, the references in float64 (top-p: probability mass; min-p: logit gap).
BOUNDARY_TOL = 1e-4


def build(rows, vocab_size, token_counts=None):
    return SamplingBatch.build(rows, vocab_size=vocab_size, device="cpu", token_counts=token_counts)


# ---------------------------------------------------------------------------------------------------
# references


def reference_filter(row: list[float], top_k: int, top_p: float, min_p: float) -> tuple[set, set]:
    """(must keep, may keep) token ids of one row of logits, in vLLM's v1 order: min-p (p >= min_p *
    p_max), then top-k over its survivors (tokens tied with the k-th kept), then top-p over the
    survivors of both (a token is kept when the strictly more likely survivors hold less than top_p).
    `may` adds the tokens within BOUNDARY_TOL, and a token within it of the min-p bound is taken
    both ways."""
    top = max(row)
    log_min_p = math.log(min_p) if min_p > 0 else -math.inf
    gaps = [value - top - log_min_p for value in row]  # >= 0: min-p keeps it
    strict = [i for i, value in enumerate(row) if value == top or gaps[i] > BOUNDARY_TOL]
    loose = [i for i in range(len(row)) if gaps[i] > -BOUNDARY_TOL]
    (must, may), (must_loose, may_loose) = (_top_k_top_p(row, c, top_k, top_p) for c in (strict, loose))
    return must & must_loose, may | may_loose


def _top_k_top_p(row: list[float], candidates: list[int], top_k: int, top_p: float) -> tuple[set, set]:
    if 0 < top_k < len(candidates):
        kth = sorted((row[i] for i in candidates), reverse=True)[top_k - 1]
        survivors = [i for i in candidates if row[i] >= kth]
    else:
        survivors = candidates
    top = max(row[i] for i in survivors)
    weights = {i: math.exp(row[i] - top) for i in survivors}
    total = sum(weights.values())
    must, may = set(), set()
    for i in survivors:
        before = sum(weights[j] for j in survivors if row[j] > row[i]) / total
        if top_p >= 1 or before < top_p - BOUNDARY_TOL:
            must.add(i)
        if top_p >= 1 or before < top_p + BOUNDARY_TOL:
            may.add(i)
    return must, may


def reference_penalties(logits, prompt, output, repetition, presence, frequency) -> list[float]:
    """vLLM's formulas, one token at a time."""
    penalised = []
    for token_id, logit in enumerate(logits):
        if token_id in prompt or token_id in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = output.count(token_id)
        penalised.append(logit - frequency * count - presence * (count > 0))
    return penalised


def reference_logprobs(row: torch.Tensor, token_id: int, num_top: int):
    """(logprob, rank, top logprobs) of `token_id` under log_softmax(row), by sorting in float64."""
    logprobs = torch.log_softmax(row.double(), -1).tolist()
    rank = sum(1 for value in logprobs if value >= logprobs[token_id])
    return logprobs[token_id], rank, sorted(logprobs, reverse=True)[:num_top], logprobs


# ---------------------------------------------------------------------------------------------------
# top-k / top-p / min-p

LOGIT_VALUES = st.one_of(st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0]),  # repeated values make ties
                         st.floats(-8, 8, allow_nan=False, width=32))


@st.composite
def filter_cases(draw):
    vocab = draw(st.integers(1, 24))
    num_rows = draw(st.integers(1, 4))
    logits = [draw(st.lists(LOGIT_VALUES, min_size=vocab, max_size=vocab)) for _ in range(num_rows)]
    top_k = [draw(st.sampled_from([-1, 0, 1, 2, vocab, vocab + 7]) | st.integers(1, vocab))
             for _ in range(num_rows)]
    top_p = [draw(st.sampled_from([1.0, 0.5, 0.9]) | st.floats(0.01, 1.0)) for _ in range(num_rows)]
    min_p = [draw(st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0.0, 1.0)) for _ in range(num_rows)]
    return logits, top_k, top_p, min_p


@settings(max_examples=300, deadline=None)
@given(filter_cases())
def test_filter_masks_match_reference(case):
    """top-k, top-p and min-p keep exactly the reference's tokens (ties, top_p = 1, top_k > vocab,
    both the top-k-only and the sorting path), and leave the kept logits unchanged."""
    logits, top_k, top_p, min_p = case
    vocab = len(logits[0])
    tensor = torch.tensor(logits, dtype=torch.float32)
    filters = LogitFilters.build(top_k, top_p, min_p, vocab_size=vocab, device="cpu")
    filtered = tensor if filters is None else filter_logits(tensor, filters)
    for row in range(len(logits)):
        kept = set(torch.isfinite(filtered[row]).nonzero().flatten().tolist())
        must, may = reference_filter(tensor[row].tolist(), top_k[row], top_p[row], min_p[row])
        assert must <= kept <= may, (row, sorted(must), sorted(kept), sorted(may))
        assert torch.equal(filtered[row, list(kept)], tensor[row, list(kept)])


def test_build_skips_unneeded_work():
    """Neutral parameters build no filters, penalties or random sub-batch (the cheap paths run)."""
    assert LogitFilters.build([0, -1, 12], [1.0, 1.0, 1.0], [0.0] * 3, vocab_size=10, device="cpu") is None
    batch = build([SamplingRow(SamplingParams(temperature=0.0), output_token_ids=[1, 2])] * 3, 10)
    assert batch.random is None and batch.penalties is None and batch.min_tokens_mask is None
    batch = build([SamplingRow(SamplingParams(temperature=0.5, top_k=3))], 10)
    assert batch.random.filters.top_p is None and batch.random.filters.log_min_p is None


# ---------------------------------------------------------------------------------------------------
# penalties and min_tokens


@st.composite
def penalty_rows(draw):
    vocab = 12
    tokens = st.lists(st.integers(0, vocab - 1), max_size=10)
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7]) | st.floats(0.5, 2.0)),
            presence_penalty=draw(st.sampled_from([0.0, 0.5]) | st.floats(-2.0, 2.0)),
            frequency_penalty=draw(st.sampled_from([0.0, -0.4]) | st.floats(-2.0, 2.0)),
        )
        rows.append((params, draw(tokens), draw(tokens), draw(st.booleans())))
    logits = draw(st.lists(st.lists(st.floats(-5, 5, width=32), min_size=vocab, max_size=vocab),
                           min_size=len(rows), max_size=len(rows)))
    return vocab, rows, logits


@settings(max_examples=100, deadline=None)
@given(penalty_rows())
def test_penalties_match_reference(case):
    """Repetition (both logit signs), presence and frequency penalties equal vLLM's formulas, whether
    the batch counts the token lists or reads the engine's TokenCounts slots (mixed in one batch)."""
    vocab, rows, logits = case
    tensor = torch.tensor(logits, dtype=torch.float32)
    counts = TokenCounts(len(rows), vocab, "cpu")
    sampling_rows = []
    for slot, (params, prompt, output, use_slot) in enumerate(rows):
        if use_slot:
            counts.reset(slot, prompt, output)
        sampling_rows.append(SamplingRow(params, prompt, output, counts_slot=slot if use_slot else None))
    penalised = penalised_logits(tensor, build(sampling_rows, vocab, counts))
    for row, (params, prompt, output, _) in enumerate(rows):
        expected = reference_penalties(logits[row], prompt, output, params.repetition_penalty,
                                       params.presence_penalty, params.frequency_penalty)
        torch.testing.assert_close(penalised[row], torch.tensor(expected, dtype=torch.float32),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("repetition", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY])
def test_extreme_repetition_penalties_keep_logits_finite(repetition):
    """At either bound of the repetition penalty, large logits of both signs stay finite, equal the
    formula's values, and greedy picks the token the formula puts first."""
    logits = [3.0e20, -2.0e20, 0.0, 1.0, -1.0]
    prompt, output = [0, 1, 2], [2]
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=repetition), prompt, output)
    penalised = penalised_logits(torch.tensor([logits]), build([row], len(logits)))
    expected = reference_penalties(logits, prompt, output, repetition, 0.0, 0.0)
    assert torch.isfinite(penalised).all()
    torch.testing.assert_close(penalised[0], torch.tensor(expected, dtype=torch.float32))
    greedy = sample(torch.tensor([logits]), build([row], len(logits))).token_ids.item()
    assert greedy == max(range(len(logits)), key=expected.__getitem__)


def test_token_counts_record_matches_recounting():
    """TokenCounts.record after each step keeps the counts equal to counting the output lists."""
    vocab, steps = 9, 6
    rows = [SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=s) for s in range(3)]
    generators = [make_generator(s, "cpu") for s in range(3)]
    prompts, outputs = [[1, 2], [3], [4, 4, 5]], [[], [7], [0, 0]]
    counts = TokenCounts(5, vocab, "cpu")
    for slot in range(3):
        counts.reset(slot + 2, prompts[slot], outputs[slot])
    for _ in range(steps):
        batch = build([SamplingRow(p, prompts[i], outputs[i], generator=generators[i], counts_slot=i + 2)
                       for i, p in enumerate(rows)], vocab, counts)
        token_ids = sample(torch.randn(3, vocab), batch).token_ids
        counts.record(batch, token_ids)
        for i, token_id in enumerate(token_ids.tolist()):
            outputs[i].append(token_id)
    for i in range(3):
        expected = torch.bincount(torch.tensor(outputs[i]), minlength=vocab).int()
        assert torch.equal(counts.output_counts[i + 2], expected)


def test_min_tokens_suppresses_eos_and_stop_ids():
    """Until min_tokens are generated, eos (under ignore_eos too, as in vLLM, whose min-tokens
    processor masks all_stop_token_ids) and stop_token_ids are masked to -inf; afterwards nothing
    is; stop ids outside the vocabulary are ignored."""
    vocab, eos, stop = 10, 9, 3
    logits = torch.zeros(6, vocab)
    logits[:, eos], logits[:, stop] = 10.0, 9.0  # (6, vocab): eos, then the stop id, most likely
    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop, 50))
    rows = [
        SamplingRow(greedy, output_token_ids=[1, 1], eos_token_ids=(eos,)),  # short: both masked
        SamplingRow(greedy.replace(temperature=1.0), eos_token_ids=(eos,)),  # sampling: both masked
        SamplingRow(greedy.replace(ignore_eos=True), eos_token_ids=(eos,)),  # both masked
        SamplingRow(greedy, output_token_ids=[1, 1, 1], eos_token_ids=(eos,)),  # long enough
        SamplingRow(greedy.replace(min_tokens=0), eos_token_ids=(eos,)),
        SamplingRow(greedy.replace(temperature=1.0), output_token_ids=[0, 0, 0, 0], eos_token_ids=(eos,)),
    ]
    batch = build(rows, vocab)
    penalised = penalised_logits(logits, batch)
    assert torch.isinf(penalised[[0, 1, 2], :][:, [eos, stop]]).all()
    assert torch.isfinite(penalised[3:]).all()
    token_ids = torch.stack([sample(logits, batch).token_ids for _ in range(50)])  # (50, 6)
    assert (token_ids[:, 0] != eos).all() and (token_ids[:, 0] != stop).all()
    assert (token_ids[:, 1] != eos).all() and (token_ids[:, 1] != stop).all()
    assert (token_ids[:, 2] != eos).all() and (token_ids[:, 2] != stop).all()
    assert (token_ids[:, 3] == eos).all()


def test_highest_temperature_keeps_masked_tokens_out():
    """At MAX_TEMPERATURE, whose float32 value is finite (a temperature that overflowed to inf made
    masked logits NaN, and the NaN token won), min_tokens-masked tokens are never sampled and the
    draw is near uniform over the rest; a higher temperature is refused."""
    assert math.isfinite(torch.tensor(MAX_TEMPERATURE, dtype=torch.float32).item())
    vocab, eos = 8, 0
    params = SamplingParams(temperature=MAX_TEMPERATURE, min_tokens=4, seed=3)
    row = SamplingRow(params, eos_token_ids=(eos,), generator=make_generator(3, "cpu"))
    logits = torch.linspace(5.0, -5.0, vocab)[None]  # (1, vocab): eos the most likely
    token_ids = [sample(logits, build([row], vocab)).token_ids.item() for _ in range(700)]
    assert eos not in token_ids
    counts = [token_ids.count(t) for t in range(1, vocab)]
    assert min(counts) > 60  # 100 each expected: a uniform draw over the 7 unmasked tokens
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=MAX_TEMPERATURE * 1.01)


def test_seeds_differing_in_their_high_bits_draw_differently():
    """torch's CPU generator keeps a seed's low 32 bits; make_generator mixes the others in, so seeds
    2**32 apart (and the -2**63 that seed 2**63 - 1's second child wraps to) draw differently, and a
    seed below 2**32 seeds the generator as it is."""
    def draws(seed):
        return torch.rand(8, generator=make_generator(seed, "cpu")).tolist()

    seeds = [5, 5 + 2**32, 5 - 2**40, 0, -(2**63), 2**63 - 1]
    assert len({tuple(draws(seed)) for seed in seeds}) == len(seeds)
    assert draws(5) == torch.rand(8, generator=torch.Generator().manual_seed(5)).tolist()


def test_largest_bias_penalty_and_smallest_temperature_stay_finite():
    """A bias of MAX_LOGIT_BIAS on a seen token, raised by the smallest repetition penalty and
    divided by the smallest sampling temperature, stays a finite logit: the token is drawn (an
    overflow to inf made the row NaN, and token 0 was drawn); a larger bias is refused."""
    vocab, token = 10, 7
    params = SamplingParams(temperature=1e-5, repetition_penalty=MIN_REPETITION_PENALTY,
                            logit_bias={token: MAX_LOGIT_BIAS}, seed=1)
    row = SamplingRow(params, prompt_token_ids=[token], generator=make_generator(1, "cpu"))
    logits = torch.linspace(3.0, -3.0, vocab)[None]  # (1, vocab)
    assert [sample(logits, build([row], vocab)).token_ids.item() for _ in range(5)] == [token] * 5
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={token: MAX_LOGIT_BIAS * 10})


# ---------------------------------------------------------------------------------------------------
# logprobs


def test_logprobs_are_those_of_the_raw_logits():
    """Chosen-token logprob, rank and top-n ids equal log_softmax of the logits before penalties,
    temperature and filters (vLLM v1's default), for every row that asks, ties included; and sample
    leaves its input logits untouched."""
    torch.manual_seed(0)
    vocab = 30
    logits = torch.randn(6, vocab) * 2  # (6, vocab)
    logits[0, :6] = 10.0  # tied most likely tokens: the chosen one's rank counts all six
    num_logprobs = [0, 1, 3, None, 5, vocab + 4]
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=n, repetition_penalty=1.5, top_k=4),
                        prompt_token_ids=[0, 1, 2], output_token_ids=[3])
            for t, n in zip([0.0, 0.7, 0.0, 1.0, 2.0, 0.0], num_logprobs, strict=True)]
    before = logits.clone()
    output = sample(logits, build(rows, vocab))
    assert torch.equal(logits, before), "sample modified its input"
    positions = output.position_logprobs()
    assert positions[3] is None
    for row, num_top in enumerate(num_logprobs):
        if num_top is None:
            continue
        token_id = output.token_ids[row].item()
        logprob, rank, top, logprobs = reference_logprobs(logits[row], token_id, num_top)
        assert math.isclose(output.logprobs.token_logprobs[row].item(), logprob, abs_tol=1e-5)
        assert output.logprobs.token_ranks[row].item() == rank
        top_ids = output.logprobs.top_ids[row, :num_top].tolist()
        torch.testing.assert_close(output.logprobs.top_logprobs[row, :min(num_top, vocab)].double(),
                                   torch.tensor(top, dtype=torch.float64), atol=1e-5, rtol=0)
        assert [logprobs[i] for i in top_ids] == pytest.approx(top, abs=1e-5)
        assert set(positions[row]) == {token_id, *top_ids}
        assert positions[row][token_id].rank == rank


def test_prompt_logprobs_match_reference():
    """prompt_logprobs gives each position's actual next token its raw logprob and rank, and the
    top-n, the same whatever the chunk size."""
    torch.manual_seed(1)
    logits = torch.randn(13, 20)  # (num_positions, vocab)
    next_ids = torch.randint(0, 20, (13,))
    result = prompt_logprobs(logits, next_ids, 3, chunk_size=4)
    for position in range(13):
        logprob, rank, top, _ = reference_logprobs(logits[position], next_ids[position].item(), 3)
        assert math.isclose(result.token_logprobs[position].item(), logprob, abs_tol=1e-5)
        assert result.token_ranks[position].item() == rank
        assert result.top_logprobs[position].tolist() == pytest.approx(top, abs=1e-5)
    whole = prompt_logprobs(logits, next_ids, 3, chunk_size=100)
    assert torch.equal(whole.token_ranks, result.token_ranks) and torch.equal(whole.top_ids, result.top_ids)


# ---------------------------------------------------------------------------------------------------
# greedy and random sampling


def test_greedy_is_argmax():
    """Greedy rows (temperature 0, or below 1e-5) take the argmax, alone or beside sampling rows, of
    fp32 or bf16 logits."""
    torch.manual_seed(2)
    logits = torch.randn(8, 50)  # (8, vocab)
    all_greedy = build([SamplingRow(SamplingParams(temperature=0.0))] * 8, 50)
    assert torch.equal(sample(logits, all_greedy).token_ids, logits.argmax(-1))
    bf16 = logits.bfloat16()  # taken as they come, not converted: the same choice as in fp32
    assert torch.equal(sample(bf16, all_greedy).token_ids, bf16.float().argmax(-1))
    temperatures = [0.0, 1.0, 1e-6, 0.8, 0.0, 1.0, 0.0, 0.5]
    mixed = build([SamplingRow(SamplingParams(temperature=t, top_k=3)) for t in temperatures], 50)
    token_ids = sample(logits, mixed).token_ids
    greedy_rows = [i for i, t in enumerate(temperatures) if t < 1e-5]
    assert torch.equal(token_ids[greedy_rows], logits[greedy_rows].argmax(-1))
    top3 = logits.topk(3).indices
    assert all(token_ids[i] in top3[i] for i in range(8))
    assert sample(torch.zeros(0, 50), build([], 50)).token_ids.shape == (0,)


FREQUENCY_CASES = {  # temperature, top_k, top_p, min_p: none of them near a boundary
    "temperature": (0.7, 0, 1.0, 0.0),
    "top_k": (1.3, 3, 1.0, 0.0),
    "top_p": (1.0, 0, 0.6, 0.0),
    "top_k_top_p_min_p": (0.9, 5, 0.95, 0.05),
}


@pytest.mark.parametrize("case", sorted(FREQUENCY_CASES))
def test_sampling_frequencies_match_distribution(case):
    """Over 20,000 draws every token's frequency is within 5 standard deviations of its probability
    under softmax(logits / T) restricted to the reference's kept tokens (P(false failure) < 1e-5),
    and masked tokens are never drawn."""
    temperature, top_k, top_p, min_p = FREQUENCY_CASES[case]
    logits = torch.tensor([2.0, 1.6, 1.0, 0.4, 0.0, -0.5, -1.0, -3.0])
    num_draws, vocab = 20_000, len(logits)
    scaled = (logits / temperature).tolist()
    must, may = reference_filter(scaled, top_k, top_p, min_p)
    assert must == may, "the case sits on a filter boundary"
    weights = [math.exp(x) if i in must else 0.0 for i, x in enumerate(scaled)]
    expected = [w / sum(weights) for w in weights]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(3)
    batch = build([SamplingRow(params)] * num_draws, vocab)  # one draw per row
    token_ids = sample(logits.expand(num_draws, vocab), batch).token_ids
    frequencies = (torch.bincount(token_ids, minlength=vocab) / num_draws).tolist()
    for token_id, (frequency, p) in enumerate(zip(frequencies, expected, strict=True)):
        assert abs(frequency - p) <= 5 * math.sqrt(p * (1 - p) / num_draws), (token_id, frequency, p)


def _seeded_tokens(seed: int, step_logits: torch.Tensor, *, with_others: bool) -> list[int]:
    """The tokens a row with `seed` draws over the steps, alone or shuffled among other rows."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    generator = make_generator(seed, "cpu")
    others = [SamplingRow(SamplingParams(temperature=0.0)),
              SamplingRow(SamplingParams(temperature=1.0, top_k=5)),
              SamplingRow(SamplingParams(temperature=0.5, min_p=0.1, seed=99),
                          generator=make_generator(99, "cpu")),
              SamplingRow(SamplingParams(temperature=1.2, top_p=0.5, repetition_penalty=1.2))]
    shuffle = random.Random(seed)
    tokens = []
    for logits in step_logits:  # (vocab,)
        rows = others[:] if with_others else []
        position = shuffle.randrange(len(rows) + 1)
        rows.insert(position, SamplingRow(params, generator=generator))
        batch_logits = torch.randn(len(rows), len(logits))  # (num_rows, vocab), advancing the global RNG
        batch_logits[position] = logits
        tokens.append(sample(batch_logits, build(rows, len(logits))).token_ids[position].item())
    return tokens


def test_seeded_rows_are_reproducible():
    """A seeded row draws the same tokens alone or in any position of a batch with seeded, unseeded,
    greedy and penalised rows; another seed draws a different sequence."""
    step_logits = torch.randn(20, 40, generator=torch.Generator().manual_seed(4))  # (steps, vocab)
    alone = _seeded_tokens(1234, step_logits, with_others=False)
    assert _seeded_tokens(1234, step_logits, with_others=True) == alone
    assert _seeded_tokens(1235, step_logits, with_others=False) != alone


def test_user_errors():
    """A seed without a generator and logits of the wrong shape are ValueErrors naming the problem."""
    with pytest.raises(ValueError, match="seed"):
        build([SamplingRow(SamplingParams(seed=1))], 10)
    with pytest.raises(ValueError, match="shape"):
        sample(torch.zeros(2, 10), build([SamplingRow(SamplingParams())], 10))
    with pytest.raises(ValueError, match="token_counts"):
        build([SamplingRow(SamplingParams(presence_penalty=1.0), counts_slot=0)], 10)


def reference_masks_and_bias(logits, params, output, eos) -> list[float]:
    """vLLM's order, one token at a time: allowed_token_ids, min_tokens, logit_bias, then penalties."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    masked = []
    for token_id, logit in enumerate(logits):
        if params.allowed_token_ids is not None and token_id not in params.allowed_token_ids:
            logit = -math.inf
        if len(output) < params.min_tokens and token_id in stops:
            logit = -math.inf
        masked.append(logit + (params.logit_bias or {}).get(token_id, 0.0))
    return reference_penalties(masked, [], output, params.repetition_penalty,
                               params.presence_penalty, params.frequency_penalty)


def test_allowed_token_ids_and_logit_bias_match_the_reference():
    """Random rows mixing allowed_token_ids, logit_bias, min_tokens and penalties give the reference's
    logits; greedy takes their argmax and sampled rows draw only allowed tokens."""
    vocab, eos, gen = 12, 11, random.Random(0)
    logits = torch.randn(24, vocab)
    rows, params_list = [], []
    for i in range(24):
        allowed = (gen.randrange(3, eos), *gen.sample(range(vocab), gen.randint(0, 4))) if i % 3 else None
        bias = {gen.randrange(vocab): gen.uniform(-5, 5) for _ in range(gen.randint(0, 3))} if i % 2 else None
        params = SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, allowed_token_ids=allowed,
                                logit_bias=bias, min_tokens=gen.choice([0, 3]),
                                presence_penalty=gen.choice([0.0, 0.7]), stop_token_ids=(2,))
        output = [gen.randrange(vocab) for _ in range(gen.randint(0, 4))]
        params_list.append((params, output))
    counts = TokenCounts(len(params_list), vocab, "cpu")
    for i, (params, output) in enumerate(params_list):
        counts.reset(i, (), output)
        rows.append(SamplingRow(params, (), output, eos_token_ids=(eos,), counts_slot=i))
    batch = build(rows, vocab, counts)
    penalised = penalised_logits(logits, batch)
    for i, (params, output) in enumerate(params_list):
        expected = reference_masks_and_bias(logits[i].tolist(), params, output, eos)
        torch.testing.assert_close(penalised[i], torch.tensor(expected, dtype=torch.float32))
    for _ in range(20):
        token_ids = sample(logits, batch).token_ids.tolist()
        for i, (params, _) in enumerate(params_list):
            if params.allowed_token_ids is not None:
                assert token_ids[i] in params.allowed_token_ids
            if params.greedy:
                assert token_ids[i] == penalised[i].argmax().item()


def test_a_structured_outputs_mask_equals_its_token_ids():
    """A guide's step may allow tokens as int64 ids (`array.array`) or as a numpy bool mask over the
    vocabulary (a grammar's bitmask): both mask the same logits to -inf, and leave the rest."""
    vocab, gen = 40, random.Random(1)
    logits = torch.randn(6, vocab)
    allowed = [sorted(gen.sample(range(vocab), gen.randint(1, vocab))) for _ in range(6)]
    masks = [np.isin(np.arange(vocab), ids) for ids in allowed]
    params = SamplingParams(temperature=0.0)
    as_ids = build([SamplingRow(params, allowed_token_ids=array.array("q", ids)) for ids in allowed], vocab)
    as_masks = build([SamplingRow(params, allowed_token_ids=mask) for mask in masks], vocab)
    expected = torch.where(torch.from_numpy(np.stack(masks)), logits, -math.inf)
    torch.testing.assert_close(penalised_logits(logits, as_masks), expected)
    torch.testing.assert_close(penalised_logits(logits, as_ids), expected)


def test_logit_bias_and_allowed_token_ids_leave_the_plain_argmax():
    """A greedy row with a bias or an allowed set is not a plain argmax (so the engine will not run
    several decode steps of it unsampled), and its bias changes the greedy choice."""
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0]])
    for params, expected in ((SamplingParams(temperature=0.0, logit_bias={1: 4.5}), 1),
                             (SamplingParams(temperature=0.0, allowed_token_ids=[2, 3]), 3)):
        assert not takes_argmax(params, num_output_tokens=0)
        row = SamplingRow(params, (), ())
        assert sample(logits, build([row], 4)).token_ids.item() == expected
    assert takes_argmax(SamplingParams(temperature=0.0), num_output_tokens=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids="12"), "allowed_token_ids"), (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(logit_bias={"1": 2.0}), "logit_bias"), (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(logit_bias={1: 1e31}), "logit_bias"),
])
def test_bad_logit_bias_and_allowed_token_ids_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_words_mask_the_token_that_would_complete_a_word():
    """A one-token bad word is always masked; a longer one's last token only when the output ends
    with the rest of it, checked against every suffix of random outputs."""
    vocab, gen = 6, random.Random(3)
    words = ((4,), (1, 2), (2, 3, 5), (0, 0))
    rows, outputs = [], []
    for _ in range(40):
        output = [gen.randrange(vocab) for _ in range(gen.randint(0, 4))]
        outputs.append(output)
        rows.append(SamplingRow(SamplingParams(temperature=0.0, bad_words=["x"]), (), output,
                                bad_words_token_ids=words))
    penalised = penalised_logits(torch.zeros(len(rows), vocab), build(rows, vocab))
    for i, output in enumerate(outputs):
        masked = {word[-1] for word in words if output[len(output) - len(word) + 1:] == list(word[:-1])
                  and len(output) >= len(word) - 1}
        assert {t for t in range(vocab) if penalised[i, t] == -math.inf} == masked, output
    assert not takes_argmax(rows[0].params, num_output_tokens=0)
