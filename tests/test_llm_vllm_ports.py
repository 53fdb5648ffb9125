"""vLLM 0.32 offline scripts that port by changing the import: mutable SamplingParams and `clone`,
vLLM's further SamplingParams fields, `CompletionOutput.finished()`, the generate / chat / beam
signatures (lora_request, a use_tqdm callable, chat's positional order, chat_template_content_format,
`chat([])`), tool-call transcripts, and the precedence of chat's named arguments.

The vLLM outcomes the tests hold slipstream to were recorded by running the same calls on vLLM 0.32
(CPU build) over a model with the same tokenizer family, and from its source where noted.
"""

from __future__ import annotations

import functools
import io

import pytest
from tqdm import tqdm

from slipstream import LLM, LoRARequest, SamplingParams
from slipstream.model.chat_template import template_content_format
from slipstream.serve.request import RequestOutputKind

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN)


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": 4, "ignore_eos": True} | overrides))


def completion(llm: LLM, prompt, params: SamplingParams):
    [output] = llm.generate(prompt, params, use_tqdm=False)
    return output.outputs[0]


def chatml(*turns: tuple[str, str], generation_prompt: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


# ---- SamplingParams: mutable, cloned, checked -----------------------------------------------------


def test_default_params_are_mutable_and_a_new_object_each_time(llm):
    """vLLM's own examples/offline_inference/basic/generate.py: get the defaults, set max_tokens,
    generate (vLLM: works; SamplingParams is a mutable msgspec Struct). The LLM's defaults stay."""
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature, params.ignore_eos = 3, 0.0, True
    assert len(completion(llm, "def f():", params).token_ids) == 3
    assert llm.get_default_sampling_params().max_tokens == 16
    assert llm.get_default_sampling_params() is not llm.get_default_sampling_params()


def test_the_engine_takes_a_checked_copy_of_each_params_object(llm):
    """As vLLM's engine clones: a request keeps the params it was added with, whatever the caller
    changes later (directly on the engine too), and a value set after construction is checked
    when the request is added."""
    engine = llm.engine
    params = greedy(max_tokens=6, extra_args={"nested": [1]})
    engine.add_request("copy", [5, 6, 7], params, stream=False)
    params.max_tokens, params.stop = 2, "e"  # a bare string stop would match its characters
    params.extra_args["nested"].append(2)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [output] = outputs
    assert len(output.outputs[0].token_ids) == 6 and output.outputs[0].finish_reason == "length"
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        llm.generate("a", params, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_clone_is_a_deep_checked_copy():
    params = SamplingParams(stop=["x"], logit_bias={5: 1.0}, extra_args={"k": [1, 2]})
    clone = params.clone()
    assert clone == params and clone is not params
    assert clone.extra_args["k"] is not params.extra_args["k"] and clone.logit_bias is not params.logit_bias
    params.min_tokens = 20  # more than max_tokens (16): caught by clone, as by the constructor
    with pytest.raises(ValueError, match=r"min_tokens \(20\) must not exceed max_tokens \(16\)"):
        params.clone()


# ---- vLLM's further SamplingParams fields ---------------------------------------------------------


def test_detokenize_false_gives_token_ids_without_text(llm):
    """vLLM 0.32: text "" and the same token ids; logprobs without decoded tokens; and stop strings
    refused (they are matched in the text)."""
    base = completion(llm, "def f():", greedy(logprobs=1, prompt_logprobs=1))
    [bare] = llm.generate("def f():", greedy(logprobs=1, prompt_logprobs=1, detokenize=False), use_tqdm=False)
    assert base.text and bare.outputs[0].text == ""
    assert bare.outputs[0].token_ids == base.token_ids
    assert [p.keys() for p in bare.outputs[0].logprobs] == [p.keys() for p in base.logprobs]
    assert all(lp.decoded_token is None for p in bare.outputs[0].logprobs for lp in p.values())
    assert all(lp.decoded_token is None for p in bare.prompt_logprobs if p for lp in p.values())
    assert any(lp.decoded_token for p in base.logprobs for lp in p.values())
    with pytest.raises(ValueError, match=r"detokenize=False cannot be used with stop=\['x'\]"):
        SamplingParams(detokenize=False, stop="x")


def test_spaces_between_special_tokens_false_gives_vllms_text(llm):
    """Three <|endoftext|> in a row, special tokens kept: vLLM 0.32 gave
    "<|endoftext|><|endoftext|><|endoftext|>" with spaces_between_special_tokens=False, which is
    what slipstream gives with either value."""
    params = greedy(max_tokens=3, logit_bias={0: 100.0}, skip_special_tokens=False)
    for spaces in (False, True):
        out = completion(llm, "def f():", params.replace(spaces_between_special_tokens=spaces))
        assert out.token_ids == [0, 0, 0]
        assert out.text == "<|endoftext|>" * 3


def test_logprobs_true_means_one_and_false_is_refused(llm):
    """vLLM turns logprobs=True (and prompt_logprobs=True) into 1."""
    params = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)
    out = completion(llm, "def f():", greedy(logprobs=True))
    assert [len(position) for position in out.logprobs] == [1] * 4  # greedy: the chosen token is top-1
    with pytest.raises(ValueError, match="logprobs must be an integer or None"):
        SamplingParams(logprobs=False)


def test_output_kind_and_extra_args_are_taken(llm):
    """vLLM's LLM returns final outputs whatever output_kind asks (it sets FINAL_ONLY); extra_args
    are carried for custom samplers and used by none."""
    base = completion(llm, "def f():", greedy())
    for kind in RequestOutputKind:
        out = completion(llm, "def f():", greedy(output_kind=kind, extra_args={"tag": 1}))
        assert (out.token_ids, out.text) == (base.token_ids, base.text)
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind, got 'delta'"):
        SamplingParams(output_kind="delta")
    with pytest.raises(ValueError, match=r"extra_args must be a dict or None, got \[1\]"):
        SamplingParams(extra_args=[1])
    for name in ("detokenize", "spaces_between_special_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
            SamplingParams(**{name: "no"})


def test_completion_finished_is_a_method_as_in_vllm(llm):
    [output] = llm.generate("x", greedy(max_tokens=2), use_tqdm=False)
    assert output.finished is True  # RequestOutput.finished: an attribute, as in vLLM
    assert output.outputs[0].finished() is True


# ---- generate and chat signatures -----------------------------------------------------------------


def test_lora_request_none_is_taken_and_an_adapter_needs_enable_lora(llm):
    assert len(llm.generate("x", greedy(max_tokens=2), use_tqdm=False, lora_request=None)) == 1
    assert len(llm.generate(["x", "y"], greedy(max_tokens=2), use_tqdm=False, lora_request=[None, None])) == 2
    adapter = LoRARequest("a", 1, "/nonexistent")
    for call in (lambda: llm.generate("x", greedy(), lora_request=adapter),
                 lambda: llm.chat(MESSAGES, greedy(), lora_request=adapter)):
        with pytest.raises(ValueError, match="LoRA is not enabled: start the engine with enable_lora=True"):
            call()
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or None"):
        llm.generate("x", greedy(), lora_request=object())
    assert not llm.engine.has_unfinished_requests()


def test_use_tqdm_may_be_the_callable_that_makes_the_bar(llm):
    """As vLLM: use_tqdm=functools.partial(tqdm, leave=False) makes the progress bar."""
    sink = io.StringIO()
    outputs = llm.generate(["x", "y"], greedy(max_tokens=2),
                           use_tqdm=functools.partial(tqdm, leave=False, file=sink, mininterval=0))
    assert len(outputs) == 2 and "2/2" in sink.getvalue()
    made = []

    def bar(**kwargs):
        made.append(kwargs)
        return tqdm(disable=True, **kwargs)

    llm.chat(MESSAGES, greedy(max_tokens=2), bar)
    assert [kwargs["total"] for kwargs in made] == [1]


def test_chat_takes_vllms_positional_order_and_no_conversations(llm):
    """vLLM's LLM.chat(messages, sampling_params, use_tqdm, lora_request, priority, chat_template,
    chat_template_content_format, add_generation_prompt, ...); chat([]) is [] (vLLM 0.32)."""
    [output] = llm.chat(MESSAGES, greedy(max_tokens=2), False)
    assert output.prompt == chatml(("user", "hi"))
    [output] = llm.chat(MESSAGES, greedy(max_tokens=2), False, None, 0, None, "string", False)
    assert output.prompt == chatml(("user", "hi"), generation_prompt=False)
    assert llm.chat([], greedy()) == []


def test_chat_template_content_format(llm):
    """"string" joins text parts; "openai" hands the template a list of {"type": "text"} parts;
    "auto" picks "openai" for a template that loops over a message's content, as vLLM."""
    loops = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": None}]
    for content_format in ("auto", "openai"):
        [output] = llm.chat(parts, greedy(max_tokens=1), use_tqdm=False, chat_template=loops,
                            chat_template_content_format=content_format)
        assert output.prompt == "[a][b][c]"
    lengths = "{% for m in messages %}{{ m['content'] | length }},{% endfor %}"
    [output] = llm.chat(parts[:2], greedy(max_tokens=1), use_tqdm=False, chat_template=lengths,
                        chat_template_content_format="openai")
    assert output.prompt == "2,1,"
    for content_format in ("auto", "string"):
        [output] = llm.chat(parts, greedy(max_tokens=1), use_tqdm=False,
                            chat_template_content_format=content_format)
        assert output.prompt == chatml(("user", "a\nb"), ("user", "c"), ("assistant", ""))
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat(MESSAGES, greedy(), chat_template_content_format="text")
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set content_parts"):
        llm.chat(MESSAGES, greedy(), chat_template_kwargs={"content_parts": True})


# The content format vLLM 0.32's chat_template_content_format="auto" detects for each template
# (vllm.renderers.hf._detect_content_format, run on these sources).
VLLM_DETECTED_FORMATS = {
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}": "string",
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}": "openai",
    "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m.content %}{{ c.text }}"
    "{% endfor %}{% endfor %}": "openai",
    "{% for m in messages|selectattr('role') %}{% for p in m['content'] | list %}{{ p.text }}{% endfor %}"
    "{% endfor %}": "openai",
    "{% for m in messages %}{% set content = m['content'] %}{% for c in content %}{{ c }}{% endfor %}"
    "{% endfor %}": "openai",
    "{% macro render(x) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}{% for m in messages %}"
    "{{ render(m.content) }}{% endfor %}": "openai",
    "{% macro render(a, x=none) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ render(1, x=m['content']) }}{% endfor %}": "openai",
    "{% macro render(content) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}{{ render(tools) }}"
    "{% for m in messages %}{{ m.content }}{% endfor %}": "string",
    "{% for t in tools or [] %}{{ t.name }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}":
        "string",
    "{% for m in messages %}{% for tc in m.tool_calls %}{{ tc.function.name }}{% endfor %}{{ m.content }}"
    "{% endfor %}": "string",
    "{% set a = messages %}{% set b = a|reverse %}{% for m in b %}{% for c in m['content'] %}{{ c }}"
    "{% endfor %}{% endfor %}": "openai",
    "{% for c in messages[0]['content'] %}{{ c }}{% endfor %}": "string",
}


@pytest.mark.parametrize("source, expected", VLLM_DETECTED_FORMATS.items(),
                         ids=[str(i) for i in range(len(VLLM_DETECTED_FORMATS))])
def test_auto_content_format_detection_matches_vllm(source, expected):
    assert template_content_format(source) == expected


# ---- chat: tool-call transcripts and the precedence of named arguments ----------------------------


def test_tool_call_transcript_with_content_none_renders(llm):
    """An OpenAI tool-call transcript (assistant content None with tool_calls): vLLM 0.32 renders
    the content as ""."""
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]
    [output] = llm.chat(conversation, greedy(max_tokens=2), use_tqdm=False)
    assert output.prompt == chatml(("user", "hi"), ("assistant", ""), ("tool", "42"))
    assert conversation[1]["content"] is None  # the caller's messages are left as they were


def test_named_arguments_win_over_chat_template_kwargs_unless_none(llm):
    """vLLM's LLM.chat merges the named arguments over chat_template_kwargs, leaving out those that
    are None: add_generation_prompt (repro: chat_template_kwargs={"add_generation_prompt": False}
    still ends with the generation prompt in vLLM 0.32), continue_final_message; tools only when
    given."""
    [output] = llm.chat(MESSAGES, greedy(max_tokens=2), use_tqdm=False,
                        chat_template_kwargs={"add_generation_prompt": False})
    assert output.prompt == chatml(("user", "hi"))
    template = "{% for t in tools or [] %}[{{ t['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"
    for tools, expected in ((None, "[kw]hi"), ([{"name": "named"}], "[named]hi")):
        [output] = llm.chat(MESSAGES, greedy(max_tokens=2), use_tqdm=False, chat_template=template,
                            tools=tools, chat_template_kwargs={"tools": [{"name": "kw"}]})
        assert output.prompt == expected

