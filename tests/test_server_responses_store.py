"""The Responses API's store (a server with VLLM_ENABLE_RESPONSES_API_STORE) as the official `openai`
client drives it: previous_response_id continues a conversation exactly as resending it whole does
(and as the chat route and transformers' template count it), GET returns what create returned,
`store` false keeps nothing, background responses run to the foreground's reply or are cancelled
with their KV blocks freed, and the store forgets the least recently used response beyond its size.

One in-process server with a store of STORE_SIZE responses serves them all; the store-less server's
answers are tests/test_server_responses.py's.
"""

from __future__ import annotations

import time

import openai
import pytest
import transformers
from server_process import MODEL_NAME, in_process

from slipstream.serve import responses_api
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.served_models import responses_api_store
from slipstream.serve.server import OpenAIServer, ServerConfig

pytest_plugins = ["serve_fixtures"]

STORE_SIZE = 4
MAX_MODEL_LEN = 512
QUESTION = "Write a haiku about caches."
FOLLOW_UP = "Now one about queues."
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=8))


@pytest.fixture(scope="module")
def api(engine) -> OpenAIServer:
    config = ServerConfig(port=0, served_model_name=MODEL_NAME, responses_store=True,
                          responses_store_size=STORE_SIZE)
    return OpenAIServer(engine, config)


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    with in_process(api) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def poll(client, response_id: str, until: tuple[str, ...], timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status not in until:
        assert time.monotonic() < deadline, f"{response_id} stayed {response.status}"
        time.sleep(0.02)
    return response


def aborted(api) -> float:
    """How many requests the server has counted as aborted (finish reason "abort")."""
    return api.metrics.registry.get_sample_value("slipstream:request_success_total",
                                                 {"model_name": api.model_name, "finished_reason": "abort"})


@pytest.fixture
def slow_steps(engine, monkeypatch) -> None:
    """Engine steps of 10 ms at least, so that a background reply of the ~490 tokens its context
    leaves runs for seconds: long enough to be aborted, which the tests check, before it finishes."""
    step = engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def wait_aborted(api, engine, before: float) -> None:
    """Within 5 s the engine holds no request and no KV block, and one more request was aborted
    than `before`: the background one, which left alone would run to its end (finish reason
    "length"; `slow_steps` keeps it running that long). The server counts the abort on the event
    loop (`AsyncEngine`'s on_step), which may come after the engine thread has let go."""
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() or engine.scheduler.kv_cache.num_used_blocks:
        assert time.monotonic() < deadline, "the request still runs"
        time.sleep(0.02)
    while aborted(api) < before + 1:
        assert time.monotonic() < deadline, "no abort counted"
        time.sleep(0.02)
    assert aborted(api) == before + 1


def test_previous_response_id_equals_resending_the_conversation(client, model_dir):
    """A second turn by previous_response_id gives the greedy reply and input_tokens of the same
    conversation sent whole as input items, and of the chat route; its input_tokens are the chat
    template's count by transformers for the user, assistant, user messages: the first turn's
    instructions are not carried over (as OpenAI documents)."""
    first = client.responses.create(model=MODEL_NAME, input=QUESTION, instructions="Answer briefly.",
                                    max_output_tokens=8, **GREEDY)
    second = client.responses.create(model=MODEL_NAME, input=FOLLOW_UP, previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": FOLLOW_UP}]
    whole = client.responses.create(model=MODEL_NAME, input=messages, max_output_tokens=8, store=False,
                                    **GREEDY)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=8,
                                          **GREEDY)
    assert second.output_text == whole.output_text == chat.choices[0].message.content
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    assert second.usage.input_tokens == whole.usage.input_tokens == chat.usage.prompt_tokens == expected
    assert (second.previous_response_id, second.store, second.instructions) == (first.id, True, None)
    assert whole.store is False


def test_previous_response_id_continues_after_a_function_call(client):
    """A function call answered by previous_response_id and a function_call_output gives the reply
    and input_tokens of the user message, the call item and its output sent whole."""
    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[weather],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=32, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and first.status == "completed"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "20 C"}
    options = dict(tools=[weather], tool_choice="none", max_output_tokens=8, **GREEDY)
    second = client.responses.create(model=MODEL_NAME, input=[answer], previous_response_id=first.id,
                                     **options)
    whole = client.responses.create(model=MODEL_NAME, store=False, **options, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), answer])
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens


def test_get_returns_the_created_response_and_store_false_keeps_nothing(client):
    """GET /v1/responses/{id} returns the Response create returned (and a stream's response.completed
    one); with store false nothing is kept: GET and previous_response_id are 404s."""
    created = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    events = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, stream=True,
                                     **GREEDY)
    [streamed] = [event.response for event in events if event.type == "response.completed"]
    assert client.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    unstored = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL_NAME, input=QUESTION, previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.cancel(created.id)  # a finished response, as vLLM answers


def test_background_runs_to_the_foreground_reply(client):
    """background true answers at once, queued or in_progress with no output; polling GET reaches
    "completed" with the foreground (unstored) reply's text and usage."""
    foreground = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=16, store=False,
                                         **GREEDY)
    started = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=16, background=True,
                                      **GREEDY)
    assert started.status in ("queued", "in_progress") and started.output == [] and started.background
    done = poll(client, started.id, until=("completed", "incomplete", "failed"))
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == foreground.output_text
    # The same but for the prefix cache: the background request finds the foreground's blocks.
    cached = {"input_tokens_details": {"cached_tokens"}}
    assert done.usage.model_dump(exclude=cached) == foreground.usage.model_dump(exclude=cached)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.cancel(done.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, input=QUESTION, background=True, store=False)
    assert error.value.body["param"] == "background"


def test_cancel_stops_a_background_response_and_frees_its_blocks(client, api, engine, slow_steps):
    """A running background response cannot be continued yet, nor, not created streamed, its events
    streamed (400s, as vLLM: it keeps events of streamed ones only).
    Cancelling it makes it "cancelled" (GET says so too) and aborts its request (`wait_aborted`)."""
    before = aborted(api)
    started = client.responses.create(model=MODEL_NAME, input=QUESTION, background=True, **GREEDY)
    poll(client, started.id, until=("in_progress",))
    with pytest.raises(openai.BadRequestError) as error:  # its output is not there to continue from
        client.responses.create(model=MODEL_NAME, input=FOLLOW_UP, previous_response_id=started.id)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:  # vLLM's replay of its events
        client.responses.retrieve(started.id, stream=True)
    assert error.value.body["param"] == "response_id"
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    wait_aborted(api, engine, before)
    assert client.responses.retrieve(started.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(started.id)


def test_a_streamed_background_response_runs_on_after_the_client_leaves(client, api, slow_steps):
    """background and stream: response.created says "queued", then response.in_progress; the client
    leaving after those does not abort it (no abort counted): GET finds it finished with the
    foreground reply's text. GET ?stream=true then replays its events, numbered 0, 1, 2, ..., their
    deltas the reply's text and the last response.completed with the Response GET returns; with
    starting_after=N, exactly those numbered after N. STORE_SIZE responses later it is forgotten,
    events and all (a 404)."""
    options = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=64, **GREEDY)
    foreground = client.responses.create(store=False, **options)
    before = aborted(api)
    with client.responses.create(background=True, stream=True, **options) as events:
        created, in_progress = next(events), next(events)
    assert created.type == "response.created" and created.response.status == "queued"
    assert created.response.background
    assert in_progress.type == "response.in_progress" and in_progress.response.status == "in_progress"
    done = poll(client, created.response.id, until=("completed", "incomplete", "failed"))
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    assert aborted(api) == before
    replayed = list(client.responses.retrieve(done.id, stream=True))
    assert [event.sequence_number for event in replayed] == list(range(len(replayed)))
    assert replayed[0].model_dump() == created.model_dump()
    text = "".join(event.delta for event in replayed if event.type == "response.output_text.delta")
    assert text == foreground.output_text
    assert replayed[-1].type == "response.completed"
    assert replayed[-1].response.model_dump() == done.model_dump()
    after = list(client.responses.retrieve(done.id, stream=True, starting_after=5))
    assert [event.model_dump() for event in after] == [event.model_dump() for event in replayed[6:]]
    for _ in range(STORE_SIZE):  # the store forgets it, and its events with it
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id, stream=True)
    assert len(api.response_store) == STORE_SIZE


def test_cancelling_a_streamed_background_response_ends_its_streams(client, api, engine, slow_steps):
    """A follower joining a live background stream (GET ?stream=true&starting_after=N) gets the
    events after N as the creating stream does; cancelling the response ends both streams (OpenAI
    names no cancelled event) after the same events, and aborts its request (`wait_aborted`)."""
    before = aborted(api)
    stream = client.responses.create(model=MODEL_NAME, input=QUESTION, background=True, stream=True,
                                     **GREEDY)
    events = iter(stream)
    first = [next(events) for _ in range(6)]
    response_id = first[0].response.id
    follower = client.responses.retrieve(response_id, stream=True, starting_after=3)
    followed = iter(follower)
    joined = [next(followed) for _ in range(2)]
    assert [event.model_dump() for event in joined] == [event.model_dump() for event in first[4:6]]
    assert client.responses.cancel(response_id).status == "cancelled"
    rest, followed_rest = list(events), list(followed)
    assert all(event.type == "response.output_text.delta" for event in rest + followed_rest)
    assert [event.sequence_number for event in first + rest] == list(range(6 + len(rest)))
    assert [event.model_dump() for event in followed_rest] == [event.model_dump() for event in rest]
    wait_aborted(api, engine, before)
    assert client.responses.retrieve(response_id).status == "cancelled"


def test_streaming_a_stored_response_checks_what_it_is_asked(client):
    """GET ?stream=true of a response not created background and streamed is a 400 naming
    response_id (as vLLM: none of its events are kept), of an unknown one a 404; starting_after that
    is not a sequence number, or a stream that is not true or false, a 400 naming it."""
    stored = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.retrieve(stored.id, stream=True)
    assert error.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32, stream=True)
    for query in ({"starting_after": "-1"}, {"starting_after": "two"}, {"starting_after": "9" * 5000},
                  {"stream": "maybe"}):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.retrieve(stored.id, extra_query=query)
        assert error.value.body["param"] == next(iter(query))
    for flag in ("t", "y", "on"):  # pydantic's bool spellings, which vLLM's parameter reads: true
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.retrieve(stored.id, extra_query={"stream": flag})
        assert error.value.body["param"] == "response_id"
    for flag in ("f", "n", "off"):
        assert client.responses.retrieve(stored.id, extra_query={"stream": flag}).id == stored.id


@pytest.mark.parametrize("streamed", [False, True])
def test_a_background_run_that_raises_fails_and_says_so(client, monkeypatch, caplog, streamed):
    """A background run that raises something other than an engine error (a server bug: here the
    Response builder) makes the Response "failed" with a server_error, logs the error, and, streamed,
    ends its stream with an error event, instead of staying "in_progress" for ever."""
    def broken(*args, **kwargs):
        raise RuntimeError("a builder bug")

    monkeypatch.setattr(responses_api.ResponseBuilder, "update" if streamed else "response", broken)
    options = dict(model=MODEL_NAME, input=QUESTION, max_output_tokens=8, background=True, **GREEDY)
    if streamed:
        events = list(client.responses.create(stream=True, **options))
        assert events[-1].type == "error"
        response_id = events[0].response.id
    else:
        response_id = client.responses.create(**options).id
    failed = poll(client, response_id, ("failed", "completed", "incomplete"))
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "a builder bug" in caplog.text


def test_a_truncated_chain_stores_only_the_history_it_rendered(client, api):
    """A chain of 40 turns by previous_response_id with truncation "auto", each turn ~60 tokens in a
    512-token context, stores for its newest turn only the items that turn rendered: the developer
    item the first turn began with and the last few turns, not the chain's ~80 items (which grow
    without bound). That history sent whole, untruncated, gives the turn's greedy reply and
    input_tokens."""
    developer = {"type": "message", "role": "developer", "content": "Count the turns."}
    options = dict(model=MODEL_NAME, truncation="auto", max_output_tokens=4, **GREEDY)
    previous = None
    for turn in range(40):
        prompt = f"Turn {turn}: " + "cache line " * 25
        items = [developer, {"role": "user", "content": prompt}] if previous is None else prompt
        previous = client.responses.create(input=items, previous_response_id=previous and previous.id,
                                           **options)
    kept = api.response_store.get(previous.id).conversation
    assert kept[0] == developer and kept[1]["role"] == "user" and len(kept) < 20
    assert kept[-1]["content"] == prompt
    whole = client.responses.create(input=kept, store=False, **options | {"truncation": "disabled"})
    assert whole.output_text == previous.output_text
    assert whole.usage.input_tokens == previous.usage.input_tokens


def test_evicting_a_running_background_response_aborts_its_request(client, api, engine, slow_steps):
    """A background response still running when STORE_SIZE newer ones (background, so that each
    is stored at once) push it out of the store is gone (404) and its request aborted: nobody could
    read its result any more."""
    before = aborted(api)
    started = client.responses.create(model=MODEL_NAME, input=QUESTION, background=True, **GREEDY)
    poll(client, started.id, until=("in_progress",))
    for _ in range(STORE_SIZE):
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1, background=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(started.id)
    wait_aborted(api, engine, before)


def test_a_background_response_cancelled_before_its_first_step_aborts_its_request(
        client, api, engine, slow_steps, monkeypatch):
    """A background response's task cancelled as soon as it is stored, before it ever runs, still
    aborts the request it submitted (its body, which would leave the stream, never runs)."""
    store = api.response_store
    put = store.put

    def put_and_cancel(response_id, entry):
        put(response_id, entry)
        entry.task.cancel()  # the event loop has not yielded since the task was created

    before = aborted(api)
    monkeypatch.setattr(store, "put", put_and_cancel)
    client.responses.create(model=MODEL_NAME, input=QUESTION, background=True, **GREEDY)
    wait_aborted(api, engine, before)


def test_the_store_forgets_the_least_recently_used_response(client):
    """Beyond STORE_SIZE responses the least recently used one is gone (404): the oldest, unless a
    GET used it since, which leaves the next oldest to go."""
    ids = [client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1).id
           for _ in range(STORE_SIZE)]
    client.responses.retrieve(ids[0])
    newest = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for response_id in (ids[0], *ids[2:], newest):
        assert client.responses.retrieve(response_id).id == response_id


def test_the_store_switch_reads_as_vllm_and_the_size_is_checked(engine):
    """VLLM_ENABLE_RESPONSES_API_STORE is on for 1 and true (any case), off unset, empty, 0 or false,
    and any other value is a ValueError; a store size below 1 is a ValueError naming it."""
    values = ["1", "true", "TRUE", "", "0", "false"]
    assert [responses_api_store({"VLLM_ENABLE_RESPONSES_API_STORE": v}) for v in values] == [
        True, True, True, False, False, False]
    assert responses_api_store({}) is False
    with pytest.raises(ValueError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        responses_api_store({"VLLM_ENABLE_RESPONSES_API_STORE": "yes"})
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(responses_store=True, responses_store_size=0)


@pytest.mark.parametrize("switch", [None, "1"])
def test_a_store_size_without_the_store_is_warned_of(switch, model_dir, monkeypatch, caplog):
    """`serve --responses-store-size` without VLLM_ENABLE_RESPONSES_API_STORE logs at start-up that
    it has no effect; with the store it sizes it, unwarned."""
    from slipstream import cli
    from slipstream.serve import server

    started = []
    monkeypatch.setattr(server, "run_server", lambda engine_config, server_config, **_: started.append(
        server_config))
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    if switch is not None:
        monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", switch)
    assert cli.main(["serve", str(model_dir), "--responses-store-size", "8"]) == 0
    [config] = started
    assert (config.responses_store, config.responses_store_size) == (switch is not None, 8)
    warned = "--responses-store-size has no effect" in caplog.text
    assert warned == (switch is None)
