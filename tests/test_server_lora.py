"""LoRA adapters over HTTP as the official `openai` client sees them: completions and chat under two
adapters and under the base model equal transformers' greedy run of the base model with that
adapter merged into its weights (lora_fixtures.merge_adapter); /v1/models lists the adapters;
vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING),
also while a request runs under the adapter; `slipstream serve`'s LoRA flags.

One real server process serves the tests here: the small model of serve_fixtures.py with adapters A
(rank 8, every projection) and B (rank 4, three projections, rsLoRA) from the start.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from lora_fixtures import merge_adapter, save_random_adapter
from serve_fixtures import assert_same_tokens, transformers_greedy
from server_process import (
    API_KEY,
    ENGINE_ARGS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ServerProcess,
    in_process,
    metric_values,
)

from slipstream.cli import build_parser, main
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.served_models import LoRAModulePath, runtime_lora_updating
from slipstream.serve.server import OpenAIServer, ServerConfig, check_lora_config

pytest_plugins = ["serve_fixtures", "server_process"]

PROMPT_IDS = [1200, 45, 3071, 99, 512]
MESSAGES = [{"role": "user", "content": "Write a haiku about caches."}]
NUM_TOKENS = 16
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def base_hf(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    """A and B, served from the start; C, loaded at run time; "rank32", more than --max-lora-rank."""
    root, hf = tmp_path_factory.mktemp("adapters"), base_hf(model_dir)
    return {
        "A": save_random_adapter(root / "A", hf, rank=8, seed=1),
        "B": save_random_adapter(root / "B", hf, rank=4, alpha=8.0, use_rslora=True, seed=2,
                                 target_modules=("q_proj", "v_proj", "down_proj")),
        "C": save_random_adapter(root / "C", hf, rank=8, seed=3),
        "rank32": save_random_adapter(root / "rank32", hf, rank=32, seed=4),
    }


@pytest.fixture(scope="module")
def chat_ids(model_dir) -> list[int]:
    """The chat's prompt as transformers' tokenizer renders it with the model's template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def references(model_dir, adapters, chat_ids) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    """Per model name: transformers' greedy tokens (and top-2 gaps) for [PROMPT_IDS, chat_ids] on
    the base model with that adapter merged (none for the served model)."""
    expected = {}
    for name in (MODEL_NAME, "A", "B", "C"):
        hf = base_hf(model_dir)
        if name != MODEL_NAME:
            merge_adapter(hf, adapters[name])
        expected[name] = transformers_greedy(hf, [PROMPT_IDS, chat_ids], NUM_TOKENS)
    return expected


@pytest.fixture(scope="module")
def lora_server(model_dir, adapters, tmp_path_factory) -> ServerProcess:
    b = json.dumps({"name": "B", "path": str(adapters["B"]), "base_model_name": MODEL_NAME})
    with pytest.MonkeyPatch.context() as patch:  # the server process inherits it
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        server = ServerProcess(model_dir, tmp_path_factory.mktemp("lora-server") / "server.log",
                               "--api-key", API_KEY, *ENGINE_ARGS, "--enable-lora", "--max-loras", "2",
                               "--lora-modules", f"A={adapters['A']}", b)
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(lora_server) -> httpx.Client:
    with httpx.Client(base_url=lora_server.url, headers=AUTH, timeout=60) as http:
        yield http


def token_ids(tokens: list[str]) -> list[int]:
    """The ids of logprobs tokens named "token_id:{id}" (return_tokens_as_token_ids)."""
    return [int(token.removeprefix("token_id:")) for token in tokens]


def served_ids(client: openai.OpenAI, model: str, chat_prompt: list[int]) -> tuple[list[int], list[int]]:
    """The greedy ids the server generates under `model` for PROMPT_IDS (completions) and MESSAGES
    (chat), checking that each response names `model` and that the chat's prompt is `chat_prompt`'s
    length."""
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    completion = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS,
                                           temperature=0, logprobs=0, extra_body=extra)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=NUM_TOKENS,
                                          temperature=0, logprobs=True, top_logprobs=0, extra_body=extra)
    assert completion.model == chat.model == model
    assert chat.usage.prompt_tokens == len(chat_prompt)
    return (token_ids(completion.choices[0].logprobs.tokens),
            token_ids([entry.token for entry in chat.choices[0].logprobs.content]))


def test_adapters_and_base_equal_transformers_with_the_adapter_merged(client, references, chat_ids):
    """Greedy completions and chat under the served model, A and B each give transformers' tokens on
    the base model with that adapter merged into its weights (fp32; the smallest top-2 logit gap of
    each reference is printed), and the response's `model` is the name requested. The three
    references differ, so a request run under the wrong adapter (or none) fails."""
    assert len({str(references[name][0]) for name in (MODEL_NAME, "A", "B")}) == 3
    for name in (MODEL_NAME, "A", "B"):
        expected, gaps = references[name]
        got = served_ids(client, name, chat_ids)
        assert_same_tokens(expected, gaps, list(got), f"model {name}")


def test_streaming_and_beam_search_under_an_adapter_equal_greedy(client):
    """Under adapter B, the streamed text of a completion and of a chat reply is the non-streamed
    one, every chunk naming B, and a beam search of one beam (which keeps the likeliest token at
    every step) gives the greedy text too."""
    options = dict(model="B", temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, **options)
    chunks = list(client.completions.create(prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, stream=True, **options))
    assert {chunk.model for chunk in chunks} == {"B"}
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    beam = client.completions.create(model="B", prompt=PROMPT_IDS, max_tokens=NUM_TOKENS,
                                     extra_body={"use_beam_search": True, "ignore_eos": True})
    assert (beam.model, beam.choices[0].text) == ("B", whole.choices[0].text)
    whole = client.chat.completions.create(messages=MESSAGES, max_completion_tokens=NUM_TOKENS, **options)
    chunks = list(client.chat.completions.create(messages=MESSAGES, max_completion_tokens=NUM_TOKENS,
                                                 stream=True, **options))
    assert {chunk.model for chunk in chunks} == {"B"}
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_models_lists_the_adapters(client, adapters, model_dir):
    """/v1/models has the served model's card, then one per adapter in load order with vLLM's fields
    (`root` the adapter's path, `parent` the served model); an adapter's card is retrievable; an
    unknown model is a 404 that names what is served, on /v1/models/{id} and on completions."""
    cards = client.models.list().data
    assert [card.id for card in cards][:3] == [MODEL_NAME, "A", "B"]
    assert (cards[0].root, cards[0].parent) == (str(model_dir), None)
    for card in cards[1:3]:
        assert (card.root, card.parent) == (str(adapters[card.id]), MODEL_NAME)
        assert card.max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve("A").root == str(adapters["A"])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert error.value.body["code"] == "model_not_found"
    assert all(repr(name) in error.value.body["message"] for name in (MODEL_NAME, "A", "B"))


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_runtime_load_and_unload(lora_server, client, http, adapters, references, chat_ids):
    """With VLLM_ALLOW_RUNTIME_LORA_UPDATING: an adapter loaded at run time serves requests under
    its name (transformers' merged reference) with the next id (3), and is listed; refusals are
    OpenAI-shaped 400s (a name taken or the served model's, a missing directory, a rank above
    --max-lora-rank, no lora_name) and 404s (unloading an adapter not served). Unloading it while
    a stream runs under it: the stream still ends as an uninterrupted run does, while new requests
    naming it get a 404."""
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": str(adapters["C"])})
    assert load.status_code == 200 and "Success" in load.text
    assert "C" in [card.id for card in client.models.list().data]
    expected, gaps = references["C"]
    assert_same_tokens(expected, gaps, list(served_ids(client, "C", chat_ids)), "model C, loaded at run time")

    refusals = [({"lora_name": "C", "lora_path": str(adapters["A"])}, "lora_name"),
                ({"lora_name": MODEL_NAME, "lora_path": str(adapters["A"])}, "lora_name"),
                ({"lora_name": "D", "lora_path": str(adapters["C"].parent / "missing")}, "lora_path"),
                ({"lora_name": "D", "lora_path": str(adapters["rank32"])}, "lora_path"),
                ({"lora_path": str(adapters["C"])}, "lora_name")]
    for body, param in refusals:
        assert_error(http.post("/v1/load_lora_adapter", json=body), 400, param)
    assert "D" not in [card.id for card in client.models.list().data]

    options = dict(model="C", prompt=PROMPT_IDS, max_tokens=MAX_MODEL_LEN - len(PROMPT_IDS), temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**options).choices[0].text
    stream = client.completions.create(stream=True, **options)
    streamed = next(iter(stream)).choices[0].text
    unload = http.post("/v1/unload_lora_adapter", json={"lora_int_id": 3})
    assert unload.status_code == 200 and "'C'" in unload.text
    assert metric_values(lora_server)["slipstream:num_requests_running"] == 1  # the stream, unfinished
    [info] = [line for line in http.get("/metrics").text.splitlines()
              if line.startswith("slipstream:lora_requests_info{")]
    assert 'running_lora_adapters="C"' in info and 'waiting_lora_adapters=""' in info  # vLLM's gauge
    assert 'max_lora="2"' in info
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="C", prompt=PROMPT_IDS, max_tokens=1)
    streamed += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == whole
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "C"}), 404, "lora_name")
    assert_error(http.post("/v1/unload_lora_adapter", json={}), 400, "lora_name")
    assert http.get("/health").status_code == 200


def test_runtime_routes_exist_only_when_allowed(model_dir, adapters):
    """As vLLM's: without VLLM_ALLOW_RUNTIME_LORA_UPDATING, /v1/load_lora_adapter and
    /v1/unload_lora_adapter do not exist (404); a start-up adapter that cannot be loaded is a
    ValueError naming it when the server is built, not a 400 at its first request."""
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=64, enable_lora=True))
    try:
        with in_process(OpenAIServer(engine, ServerConfig(port=0))) as url:
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                response = httpx.post(url + route, json={"lora_name": "C", "lora_path": str(adapters["C"])})
                assert response.status_code == 404
        bad = LoRAModulePath(name="big", path=str(adapters["rank32"]))
        with pytest.raises(ValueError, match="'big'"):
            OpenAIServer(engine, ServerConfig(port=0, lora_modules=(bad,)))
    finally:
        engine.shutdown()


def test_serve_refuses_bad_lora_setups_before_serving(model_dir, adapters, capsys, monkeypatch):
    """`slipstream serve` exits with status 2 and a one-line error, not a traceback and not at the
    first request: --lora-modules without --enable-lora (before the model loads, as vLLM fails at
    start), a start-up adapter that cannot be loaded, a VLLM_ALLOW_RUNTIME_LORA_UPDATING that is
    neither true nor false."""
    serve = ["serve", str(model_dir), "--port", "0", "--max-model-len", "64"]
    assert main([*serve, "--lora-modules", f"A={adapters['A']}"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert main([*serve, "--enable-lora", "--lora-modules", f"big={adapters['rank32']}"]) == 2
    assert "'big'" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "yes")
    assert main([*serve, "--enable-lora"]) == 2
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in capsys.readouterr().err


def test_lora_modules_parse_both_vllm_forms():
    """--lora-modules takes name=path and vLLM's JSON object, several per flag and over repeated
    flags, in order; the LoRA engine flags reach their namesakes."""
    args = build_parser().parse_args([
        "serve", "m", "--lora-modules", "a=/adapters/a",
        '{"name": "b", "path": "/b=c", "base_model_name": "m"}', "--lora-modules", "c=rel/c",
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras", "4"])
    assert args.lora_modules == [LoRAModulePath(name="a", path="/adapters/a"),
                                 LoRAModulePath(name="b", path="/b=c", base_model_name="m"),
                                 LoRAModulePath(name="c", path="rel/c")]
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 3, 64, 4)


@pytest.mark.parametrize("entry, reason", [
    ("adapter", "neither name=path nor a JSON object"),
    ("=/path", "name must be a non-empty string"),
    ("a=", "path must be a non-empty string"),
    ('{"name": "a"', "not valid JSON"),
    ('{"name": "a"}', "lacks path"),
    ('{"name": "a", "path": "/p", "rank": 8}', "unknown keys"),
    ('{"name": "a", "path": 3}', "path must be a non-empty string"),
])
def test_malformed_lora_modules_are_argparse_errors(entry, reason, capsys):
    """A malformed --lora-modules entry is argparse's error (status 2) naming the flag and the fault."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "m", "--lora-modules", entry])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules" in err and reason in err


def test_lora_config_checks():
    """The checks behind the flags: VLLM_ALLOW_RUNTIME_LORA_UPDATING read as vLLM reads it (1 or
    true, any case), adapters named twice or as the served model, and adapters for an engine
    without enable_lora, each a ValueError."""
    values = ("1", "True", " true", "0", "FALSE", "")
    assert [runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": v}) for v in values] == [
        True, True, True, False, False, False]
    assert runtime_lora_updating({}) is False
    module = LoRAModulePath(name="a", path="/a")
    with pytest.raises(ValueError, match="twice"):
        ServerConfig(lora_modules=(module, module))
    with pytest.raises(ValueError, match="enable_lora"):
        check_lora_config(EngineConfig(model="m"), ServerConfig(lora_modules=(module,)))
    with pytest.raises(ValueError, match="served model's name"):
        check_lora_config(EngineConfig(model="m", enable_lora=True),
                          ServerConfig(served_model_name="a", lora_modules=(module,)))
