"""Decode steps through CUDA graphs (`serve.cuda_graph`) compute what the unpadded step computes.

On a CPU the bucketing runs with `capture=False` (static buffers and padding rows, each step run
eagerly): padded steps must give the unpadded step's hidden states and cache writes, leave every
other block but the spare one untouched, and greedy generation through them must be
transformers'. With a GPU, the same checks run on captured graphs.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from serve_fixtures import random_model

from slipstream import LLM, SamplingParams
from slipstream.model.create import stdlib_tokenizer
from slipstream.ops.paged_attention import PagedBatch
from slipstream.serve.cuda_graph import CudaDecodeGraphs, batch_buckets, width_bucket
from slipstream.serve.runner import PagedAttention, PagedKVCache

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 16
CUDA = torch.cuda.is_available()


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="max_seqs"):
        batch_buckets(0)


def test_width_bucket():
    assert [width_bucket(w, 16) for w in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert width_bucket(11, 12) == 12
    for bad in (0, 17):
        with pytest.raises(ValueError, match="width"):
            width_bucket(bad, 16)


def _forward(model, cache):
    def forward(token_ids, positions, batch):
        return model.hidden_states(token_ids[None], positions[None], PagedAttention(cache, batch, False))[0]
    return forward


@pytest.mark.parametrize("seq_lens", [[1], [9], [5, 17, 2], [30, 8, 13, 4, 1], [7] * 16 + [3, 50]],
                         ids=lambda s: f"{len(s)}seqs")
def test_padded_step_equals_unpadded_step(family_config, seq_lens):
    """Every family (a sliding window of 7 in mistral's), batches padded up to 1, 2, 4, 8, 32 rows
    and block tables up to a power of two: the hidden states equal the unpadded step's, the keys
    and values land in the same slots, and only the spare block gets anything else."""
    model = random_model(family_config)
    rng = random.Random(len(seq_lens))
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    cache = PagedKVCache(family_config, num_blocks=NUM_BLOCKS + 1, block_size=BLOCK_SIZE,
                         dtype=torch.float32, device=torch.device("cpu"))
    for tensor in [*cache.keys, *cache.values]:
        tensor.copy_(torch.randn(tensor.shape))
    batch = PagedBatch.build(seq_lens=seq_lens, query_lens=[1] * len(seq_lens), block_tables=tables,
                             block_size=BLOCK_SIZE)
    token_ids = torch.randint(0, family_config.vocab_size, (len(seq_lens),))
    positions = torch.tensor([n - 1 for n in seq_lens])
    graph_cache = copy.deepcopy(cache)
    graphs = CudaDecodeGraphs(_forward(model, graph_cache), max_seqs=32, max_blocks=MAX_BLOCKS,
                              block_size=BLOCK_SIZE, pad_block=NUM_BLOCKS, device=torch.device("cpu"),
                              capture=False)
    with torch.inference_mode():
        expected = _forward(model, cache)(token_ids, positions, batch)
        got = graphs(token_ids, positions, batch)

    assert got.shape == expected.shape == (len(seq_lens), family_config.hidden_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for layer in range(family_config.num_hidden_layers):
        for graph_tensor, tensor in ((graph_cache.keys[layer], cache.keys[layer]),
                                     (graph_cache.values[layer], cache.values[layer])):
            torch.testing.assert_close(graph_tensor[:NUM_BLOCKS], tensor[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
            untouched = [b for b in range(NUM_BLOCKS) if b not in {t[-1] for t in tables}]
            assert torch.equal(graph_tensor[untouched], tensor[untouched])


def test_rejects_steps_it_cannot_run(family_config):
    model = random_model(family_config)
    cache = PagedKVCache(family_config, num_blocks=5, block_size=BLOCK_SIZE, dtype=torch.float32,
                         device=torch.device("cpu"))
    graphs = CudaDecodeGraphs(_forward(model, cache), max_seqs=2, max_blocks=MAX_BLOCKS,
                              block_size=BLOCK_SIZE, pad_block=4, device=torch.device("cpu"), capture=False)
    three = PagedBatch.build(seq_lens=[2, 3, 4], query_lens=[1, 1, 1], block_tables=[[0], [1], [2]],
                             block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="1 to 2 decoding sequences"):
        graphs(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), three)
    prefill = PagedBatch.build(seq_lens=[3], query_lens=[3], block_tables=[[0]], block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="prefill"):
        graphs(torch.zeros(3, dtype=torch.int64), torch.arange(3), prefill)
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA device"):
            CudaDecodeGraphs(_forward(model, cache), max_seqs=2, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE,
                             pad_block=4, device=torch.device("cpu"))


def _greedy_reference(hf, prompts, max_new_tokens):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


@pytest.fixture
def mistral_dir(make_hf_model, tmp_path):
    """A Mistral model with a 24-token window, shorter than the prompts."""
    hf = make_hf_model("mistral", hidden_size=128, num_attention_heads=4, head_dim=32, sliding_window=24,
                       initializer_range=0.1)
    hf.save_pretrained(tmp_path)
    stdlib_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in torch.randint(5, 60, (9,), generator=g).tolist()]
    return tmp_path, prompts, _greedy_reference(hf, prompts, 20)


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_engine_through_padded_steps_matches_transformers(mistral_dir, num_scheduler_steps):
    """Greedy generation whose decode steps all go through the bucketed static buffers (at most 5
    running requests: batches of 1 to 5 padded to 1, 2, 4, 5; block tables of 1 to 5 blocks
    padded to 1, 2, 4, 8), one decode step per engine step or four: transformers' tokens."""
    model_dir, prompts, expected = mistral_dir
    llm = LLM(str(model_dir), max_num_seqs=5, block_size=BLOCK_SIZE, enforce_eager=True,
              fast_cpu_kernels=False, num_scheduler_steps=num_scheduler_steps)
    engine = llm.engine
    runner = engine.runner
    # Laid out as Runner.__init__ lays out a CUDA cache: the pool, the zeroed null block standing for
    # the blocks the window released, then the padding rows' block past it.
    num_blocks, groups = engine.limits.num_blocks, runner.cache.groups
    null_blocks = 1 if groups.has_windows else 0
    runner.cache = PagedKVCache(engine.model_config, num_blocks=num_blocks + null_blocks + 1,
                                block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"),
                                groups=groups)
    if null_blocks:
        runner.cache.zero_block(num_blocks)
    runner.decode_graph = CudaDecodeGraphs(
        runner.hidden_states, max_seqs=5, max_blocks=-(-engine.limits.max_model_len // BLOCK_SIZE),
        block_size=BLOCK_SIZE, pad_block=num_blocks + null_blocks, device=torch.device("cpu"), capture=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert runner.decode_graph.num_captured >= 4


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_captured_graphs_match_transformers_and_eager(mistral_dir):
    """On a GPU: decode steps replay captured graphs, and the greedy tokens are transformers', those
    of enforce_eager=True and those of four decode steps per engine step."""
    model_dir, prompts, expected = mistral_dir
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=5, block_size=BLOCK_SIZE)
    assert isinstance(llm.engine.runner.decode_graph, CudaDecodeGraphs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.runner.decode_graph.num_captured >= 4
    eager = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=5, block_size=BLOCK_SIZE,
                enforce_eager=True)
    assert eager.engine.runner.decode_graph is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == got
    assert got == expected
    multi_step = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=5, block_size=BLOCK_SIZE,
                     num_scheduler_steps=4)
    assert [o.outputs[0].token_ids for o in multi_step.generate(prompts, params, use_tqdm=False)] == got


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_sampling_features_on_cuda_match_the_cpu(mistral_dir):
    """On a GPU: what the sampler computes besides the greedy token (top-n and prompt logprobs,
    penalties) is the CPU engine's, and seeded sampling of n=2 repeats itself."""
    model_dir, prompts, _ = mistral_dir
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(model_dir), device=device, dtype="float32", max_num_seqs=5, block_size=BLOCK_SIZE)
        runs[device] = llm.generate(prompts, params, use_tqdm=False)
    for cpu, cuda in zip(runs["cpu"], runs["cuda"], strict=True):
        assert cuda.outputs[0].token_ids == cpu.outputs[0].token_ids
        for got, want in zip(cuda.outputs[0].logprobs + cuda.prompt_logprobs[1:],
                             cpu.outputs[0].logprobs + cpu.prompt_logprobs[1:], strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, n=2, seed=7, max_tokens=8)
    first, second = (llm.generate(prompts[:3], seeded, use_tqdm=False) for _ in range(2))
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs]
                                                                  for o in second]
