"""Embeddings (`LLM(..., runner="pooling")`, `LLM.embed`; slipstream/serve/pooling.py) equal
transformers' `AutoModel` hidden states pooled and normalised as the model directory's
sentence-transformers files say: the last token's, the mean or the first token's, under chunked
prompts, preemption and prefix caching; Matryoshka dimensions and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from serve_fixtures import MAX_POSITIONS, kv_bytes_for_blocks

from slipstream import LLM, PoolingParams
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.pooling import Pool

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

transformers = pytest.importorskip("transformers")

TEXTS = ["def f(x):", "import os\nimport sys\n" * 6, "hello", "class A:\n    pass\n" * 11,
         "x = [i * i for i in range(10)]", "# a comment " * 20, "é😀 unicode", "return None"]
SHARED = "def shared_prefix(a, b):\n    return a + b\n" * 4
PREFIXED = [SHARED + tail for tail in ("x", "yy = 1", "print('z')")] + [SHARED] * 2


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' hidden states of a text or of token ids: (T, E), final norm applied."""
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    @torch.no_grad()
    def hidden(prompt: str | list[int]) -> torch.Tensor:
        if isinstance(prompt, str):
            return model(**tokenizer(prompt, return_tensors="pt")).last_hidden_state[0]
        return model(input_ids=torch.tensor([prompt])).last_hidden_state[0]

    return hidden


def pooled(hidden: torch.Tensor, pooling: str, normalize: bool = True) -> torch.Tensor:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(outputs, expected: list[torch.Tensor]) -> None:
    assert len(outputs) == len(expected)
    errors = [(torch.tensor(o.outputs.embedding) - e).abs().max().item()
              for o, e in zip(outputs, expected, strict=True)]
    print(f"max |embedding - transformers'|: {max(errors):.2e}")
    assert max(errors) < 1e-5


ENGINES = {  # name: LLM arguments
    "plain": {},
    "every prompt chunked": dict(max_num_batched_tokens=7),
    "a small KV cache": dict(kv_cache_memory=kv_bytes_for_blocks(6, 16), max_model_len=80,
                             max_num_batched_tokens=16),
    "no prefix caching": dict(enable_prefix_caching=False),
    "eager": dict(enforce_eager=True, fast_cpu_kernels=False),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_last_token_embeddings_equal_transformers(model_dir, reference, engine):
    """The default for a directory without sentence-transformers files, as vLLM's: the last
    token's hidden state, L2-normalised; prompts with shared prefixes (prefix caching reuses their
    blocks) and repeated ones give the same vectors as alone."""
    llm = LLM(model_dir, runner="pooling", **{"max_model_len": MAX_POSITIONS} | ENGINES[engine])
    texts = TEXTS + PREFIXED
    outputs = llm.embed(texts, use_tqdm=False)
    assert_close(outputs, [pooled(reference(text), "LAST") for text in texts])
    assert all(len(o.outputs.embedding) == o.outputs.hidden_size == 128 for o in outputs)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0


def with_sentence_transformers(model_dir, tmp_path, pooling: str, normalize: bool):
    """A copy of the model directory with sentence-transformers' modules.json and Pooling config."""
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    modes = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens",
             "CLS": "pooling_mode_cls_token"}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 128} | {key: key == modes[pooling] for key in modes.values()}))
    return tmp_path


@pytest.mark.parametrize("pooling, normalize", [("MEAN", True), ("CLS", False), ("LAST", False)])
def test_sentence_transformers_pooling_equals_transformers(model_dir, reference, tmp_path, pooling,
                                                           normalize):
    """The Pooling module's mode and a Normalize module (or its absence) are followed; the mean
    is over every prompt position, so it holds across chunks (prefix caching is off for it: a
    cached prefix's positions would be missing)."""
    directory = with_sentence_transformers(model_dir, tmp_path, pooling, normalize)
    llm = LLM(str(directory), runner="pooling", max_model_len=80, max_num_batched_tokens=9,
              kv_cache_memory=kv_bytes_for_blocks(6, 16))
    texts = TEXTS + PREFIXED
    assert_close(llm.embed(texts, use_tqdm=False), [pooled(reference(t), pooling, normalize) for t in texts])
    assert llm.engine.scheduler.config.enable_prefix_caching == (pooling == "LAST")
    override = llm.embed(texts[:2], pooling_params=PoolingParams(use_activation=not normalize),
                         use_tqdm=False)
    assert_close(override, [pooled(reference(t), pooling, not normalize) for t in texts[:2]])


def test_matryoshka_dimensions(model_dir, reference, tmp_path):
    """A model whose config.json says it is a Matryoshka one keeps the first `dimensions` of the
    pooled state, then normalises; other models refuse a smaller `dimensions`."""
    plain = LLM(model_dir, runner="pooling", max_model_len=MAX_POSITIONS)
    with pytest.raises(ValueError, match="dimensions=32: this model is no Matryoshka model"):
        plain.embed("hi", pooling_params=PoolingParams(dimensions=32), use_tqdm=False)
    assert len(plain.embed("hi", pooling_params=PoolingParams(dimensions=128), use_tqdm=False)[0]
               .outputs.embedding) == 128
    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [32, 64, 128]}))
    llm = LLM(str(tmp_path), runner="pooling", max_model_len=MAX_POSITIONS)
    [output] = llm.embed(TEXTS[1], pooling_params=PoolingParams(dimensions=32), use_tqdm=False)
    expected = torch.nn.functional.normalize(reference(TEXTS[1])[-1][:32], dim=0)
    assert_close([output], [expected])
    with pytest.raises(ValueError, match=r"dimensions=48 is not one this model has: \[32, 64, 128\]"):
        llm.embed("hi", pooling_params=PoolingParams(dimensions=48), use_tqdm=False)


def test_a_repeated_prompt_reuses_its_cached_blocks(model_dir, reference):
    """Last-token pooling keeps prefix caching: a prompt embedded again finds its full blocks
    cached and computes the rest, to the same vector."""
    llm = LLM(model_dir, runner="pooling", max_model_len=MAX_POSITIONS)
    [first] = llm.embed(TEXTS[3], use_tqdm=False)
    [again] = llm.embed(TEXTS[3], use_tqdm=False)
    block_size = llm.engine.config.block_size
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // block_size * block_size > 0
    assert_close([first, again], [pooled(reference(TEXTS[3]), "LAST")] * 2)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_a_prompt_may_fill_the_context(model_dir, reference, tmp_path, pooling):
    """As in vLLM, a prompt to embed may be as long as the context (one to generate from must
    leave room for a token), here in chunks through a KV cache of 96 token slots for 80 tokens."""
    directory = with_sentence_transformers(model_dir, tmp_path, pooling, True)
    llm = LLM(str(directory), runner="pooling", max_model_len=80, max_num_batched_tokens=9,
              kv_cache_memory=kv_bytes_for_blocks(6, 16))
    ids = llm.get_tokenizer().encode(TEXTS[3] * 2)[:80]
    assert len(ids) == 80
    outputs = llm.embed([ids, ids[:79]], use_tqdm=False)
    assert_close(outputs, [pooled(reference(ids), pooling), pooled(reference(ids[:79]), pooling)])
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    with pytest.raises(ValueError, match="prompt has 81 tokens, but the model's context length is 80"):
        llm.embed(ids + [1], use_tqdm=False)


def test_prompts_as_token_ids_and_dicts(model_dir, reference):
    llm = LLM(model_dir, runner="pooling", max_model_len=MAX_POSITIONS)
    ids = llm.get_tokenizer().encode(TEXTS[0])
    outputs = llm.embed([ids, {"prompt_token_ids": ids}, {"prompt": TEXTS[0]}], use_tqdm=False)
    assert_close(outputs, [pooled(reference(TEXTS[0]), "LAST")] * 3)
    assert [o.prompt_token_ids for o in outputs] == [ids] * 3
    # vLLM's pooling runner truncates on the right: a prompt keeps its first k tokens
    [truncated, truncated_ids] = llm.embed([TEXTS[1], ids], truncate_prompt_tokens=5, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt is not supported for embeddings"):
        llm.embed({"prompt_token_ids": ids, "cache_salt": "a"}, use_tqdm=False)
    assert truncated.prompt_token_ids == llm.get_tokenizer().encode(TEXTS[1])[:5]
    assert truncated_ids.prompt_token_ids == ids[:5]


def test_bad_input_and_the_wrong_runner(model_dir, tmp_path):
    llm = LLM(model_dir, runner="pooling", max_model_len=MAX_POSITIONS)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match=f"prompt has {MAX_POSITIONS + 1} tokens, but the model's context"):
        llm.embed([1] * (MAX_POSITIONS + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="it takes add_embedding_request"):
        llm.generate("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="use_activation must be"):
        PoolingParams(use_activation="yes")
    with pytest.raises(ValueError, match="runner must be 'auto', 'generate' or 'pooling'"):
        EngineConfig(model=str(model_dir), runner="embed")
    with pytest.raises(ValueError, match="embedding needs runner='pooling'"):
        LLM(model_dir, max_model_len=MAX_POSITIONS).embed("hi", use_tqdm=False)
    directory = with_sentence_transformers(model_dir, tmp_path, "MEAN", True)
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (directory / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="lists modules slipstream does not run: Dense"):
        LLM(str(directory), runner="pooling", max_model_len=MAX_POSITIONS)


def test_an_aborted_embedding_frees_its_blocks(model_dir):
    engine = Engine(EngineConfig(model=str(model_dir), runner="pooling", max_model_len=MAX_POSITIONS,
                                 max_num_batched_tokens=8))
    engine.add_embedding_request("a", TEXTS[5])
    assert engine.step() == []  # the first chunk only
    assert engine.scheduler.kv_cache.num_used_blocks > 0
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_a_pool_restarts_with_a_recomputed_prompt(pooling):
    """A preempted prompt is computed again from position 0; what its first pass added is dropped."""
    hidden = torch.randn(7, 4)
    pool = Pool(pooling)
    pool.add(torch.randn(3, 4), 0)  # the pass a preemption cut short
    pool.add(hidden[:5], 0)
    pool.add(hidden[5:], 5)
    torch.testing.assert_close(pool.result(), pooled(hidden, pooling, normalize=False))



def test_the_embeddings_route_equals_the_offline_engine(model_dir):
    """`slipstream serve --runner pooling` answers OpenAI's embeddings call, through the official
    client, with the offline engine's vectors: texts and token ids, floats and base64 (the
    client's default, which it decodes), usage counting the prompt tokens; generation routes,
    an empty input, one longer than the context and a `dimensions` the model lacks are 400s."""
    openai = pytest.importorskip("openai")
    from server_process import MODEL_NAME, metric_values, serve_in_process

    llm = LLM(model_dir, runner="pooling", max_model_len=MAX_POSITIONS)
    ids = llm.get_tokenizer().encode(TEXTS[3])
    expected = llm.embed([TEXTS[0], TEXTS[1], ids], use_tqdm=False)
    with serve_in_process(model_dir, "--runner", "pooling", "--max-model-len", str(MAX_POSITIONS)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts = client.embeddings.create(model=MODEL_NAME, input=[TEXTS[0], TEXTS[1]])
        as_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
        got = [item.embedding for item in texts.data] + [as_ids.data[0].embedding]
        errors = [max(abs(a - b) for a, b in zip(g, e.outputs.embedding, strict=True))
                  for g, e in zip(got, expected, strict=True)]
        assert max(errors) < 1e-5, errors
        assert [item.index for item in texts.data] == [0, 1]
        assert texts.usage.prompt_tokens == texts.usage.total_tokens == sum(
            len(e.prompt_token_ids) for e in expected[:2])
        first, last = (client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float",
                                                extra_body={"truncate_prompt_tokens": 4, **side})
                       for side in ({}, {"truncation_side": "left"}))
        [head, tail] = llm.embed([ids[:4], ids[-4:]], use_tqdm=False)
        for response, output in ((first, head), (last, tail)):
            assert max(abs(a - b) for a, b in zip(response.data[0].embedding, output.outputs.embedding,
                                                  strict=True)) < 1e-5
        too_long = [1] * (MAX_POSITIONS + 1)
        calls = ((lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2), None),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x",
                                                   extra_body={"truncation_side": "middle"}),
                  "truncation_side"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x", encoding_format="base64",
                                                   extra_body={"embed_dtype": "float16"}), "embed_dtype"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x", encoding_format="base64",
                                                   extra_body={"endianness": "big"}), "endianness"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input=ids,
                                                   extra_body={"truncate_prompt_tokens": 0}),
                  "truncate_prompt_tokens"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x",
                                                   extra_body={"cache_salt": "a"}), "cache_salt"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x",
                                                   extra_body={"priority": 2}), "priority"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input=[]), "input"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input=too_long), "input"),
                 (lambda: client.embeddings.create(model=MODEL_NAME, input="x", dimensions=8), "dimensions"))
        # vLLM applies the base64 layouts to base64 alone: a float response ignores them
        floats = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float",
                                          extra_body={"embed_dtype": "float16", "endianness": "big"})
        assert max(abs(a - b) for a, b in zip(floats.data[0].embedding, as_ids.data[0].embedding,
                                              strict=True)) < 1e-5
        for call, param in calls:
            with pytest.raises(openai.BadRequestError) as error:
                call()
            assert error.value.body["param"] == param
        metrics = metric_values(server)
        assert metrics["slipstream:prompt_tokens_total"] == texts.usage.prompt_tokens + 2 * len(ids) + 2 * 4


def test_vllms_removed_normalize_field_is_refused_not_ignored():
    """`normalize` (older vLLM's name of use_activation) is a 400 naming it, as vLLM 0.32 answers;
    it was dropped silently and the vectors came back normalised whatever it said."""
    from slipstream.serve import protocol

    body = protocol.parse_body(protocol.EmbeddingRequest, b'{"input": "hi", "normalize": false}')
    with pytest.raises(protocol.APIError) as error:
        body.check_supported()
    assert (error.value.status_code, error.value.param) == (400, "normalize")
    assert "use_activation" in error.value.message
