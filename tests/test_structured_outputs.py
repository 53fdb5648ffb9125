"""Structured outputs: the guide's allowed tokens on a hand-made vocabulary; generation that spells
one of the choices, greedy equal to a dense reference that masks by brute force; outputs that match
regexes, JSON schemas and context-free grammars (llguidance's, checked against the regex guide and
a recursive-descent recognizer)."""

from __future__ import annotations

import functools
import json
import logging
import re
import sys

import pytest
import torch
from serve_fixtures import dense_logprobs

from slipstream import LLM, SamplingParams
from slipstream.serve.fsm import ByteDFA
from slipstream.serve.structured import Guide, StructuredOutputsParams, Vocabulary

pytest_plugins = ["serve_fixtures"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EURO = "€"  # three bytes: e2 82 ac
EOS = 0
# Every single byte (ids 1..256, as a byte-level BPE has them), then some longer tokens.
TOKENS = [None, *(bytes([b]) for b in range(256)), b"ab", b"abc", b"\xe2\x82", b"yes", b"no"]
ID = {data: i for i, data in enumerate(TOKENS) if data}


def guide(pattern: str) -> Guide:
    return Guide(ByteDFA(pattern), Vocabulary(TOKENS), eos_token_ids=[EOS])


def walk(g: Guide, tokens: list[bytes]):
    state = g.start
    for data in tokens:
        state = g.advance(state, ID[data])
    return state


def names(g: Guide, state) -> list:
    return sorted(TOKENS[t] or b"<eos>" for t in g.allowed_token_ids(state))


def test_allowed_tokens_keep_the_output_able_to_match():
    """At each point the allowed tokens are exactly those whose bytes lead on to a possible match,
    with end-of-sequence where the output matches; a multi-byte character may be split."""
    g = guide(StructuredOutputsParams(choice=["ab", "abc", EURO]).pattern)
    assert names(g, g.start) == [b"a", b"ab", b"abc", b"\xe2", b"\xe2\x82"]
    assert names(g, walk(g, [b"a"])) == [b"b"]
    assert names(g, walk(g, [b"ab"])) == [b"<eos>", b"c"]  # "ab" is complete, or "c" follows
    assert names(g, walk(g, [b"abc"])) == [b"<eos>"]
    assert names(g, walk(g, [b"\xe2"])) == [b"\x82"]
    assert names(g, walk(g, [b"\xe2\x82"])) == [b"\xac"]
    assert walk(g, [b"a", b"b"]) == walk(g, [b"ab"])  # the same state, however it was spelt
    assert walk(g, [b"ab", b"c", b"c"]) is None
    assert g.advance(walk(g, [b"ab"]), EOS) is None and list(g.allowed_token_ids(None)) == [EOS]
    digits = guide(r"[0-9]+(yes|no)?")
    assert names(digits, digits.start) == sorted(bytes([b]) for b in b"0123456789")
    after = walk(digits, [b"4"])
    assert names(digits, after) == sorted([b"<eos>", b"n", b"no", b"y", b"yes",
                                           *(bytes([b]) for b in b"0123456789")])


def test_a_vocabulary_without_every_byte_is_a_value_error():
    with pytest.raises(ValueError, match="structured outputs need a token for every byte"):
        Vocabulary([b"a", b"b"])


@pytest.mark.parametrize("params, message", [
    (dict(regex="(a)\\1"), "structured_outputs.regex: .* backreferences are not supported"),
    (dict(grammar="root ::= 'a'"), "structured_outputs.grammar: .*GBNF to Lark"),
    (dict(grammar="root ::= expr"), "structured_outputs.grammar: .*Rule 'expr' not found"),
    (dict(grammar="start: /a(/"), "structured_outputs.grammar: .*invalid regex"),
    (dict(grammar=" "), "structured_outputs.grammar must be a non-empty string"),
    (dict(grammar={"root": "a"}), "structured_outputs.grammar must be a non-empty string"),
    (dict(json={"type": "array", "uniqueItems": True}),
     "structured_outputs.json: #: uniqueItems cannot be enforced .*; nor can llguidance: .*uniqueItems"),
    (dict(json="{not json"), "structured_outputs.json: the JSON schema is not valid JSON"),
    # llguidance panics cutting this schema's text inside U+0080 for its message (found by the
    # server's random requests): a ValueError, not a BaseException that became a 500
    (dict(json={"pattern": [{"type": None}, {"schema": None, "json_object": None, "grammar": False,
                                              "type": "00\x1f\x1f\x1f\x1f\x80"}]}),
     "structured_outputs.json: .*nor can llguidance: llguidance failed on it"),
    # a chain of 3,000 $refs or rules overflowed the stack of llguidance's Rust recursion: the
    # process died (a segmentation fault), every request with it
    (dict(json={"$ref": "#/$defs/a0", "$defs": {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(3000)}
                | {"a3000": {"type": "integer"}}}),
     r"structured_outputs.json: the schema reaches 3,001 subschemas with a \$ref or an allOf, more than"),
    (dict(grammar="start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(3000)) + 'a3000: "x"\n'),
     "structured_outputs.grammar defines 3,002 rules, more than the 1,000 a grammar may have"),
    (dict(), "needs exactly one of choice, regex, json, json_object and grammar, got none"),
    (dict(choice=["a"], regex="a"), r"needs exactly one of .*, got \['choice', 'regex'\]"),
    (dict(choice=[]), "non-empty list of non-empty strings"),
    (dict(choice="yes"), "non-empty list of non-empty strings"),
    (dict(choice=["yes", ""]), "non-empty list of non-empty strings"),
])
def test_bad_structured_outputs_are_value_errors(params, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**params)


@pytest.mark.parametrize("conflict", [dict(ignore_eos=True), dict(min_tokens=2), dict(allowed_token_ids=[5])])
def test_structured_outputs_conflicts_are_value_errors(conflict):
    with pytest.raises(ValueError, match="cannot be used with structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]), **conflict)


CHOICES = ["positive", "negative", "neutral 😀", "positively", "no"]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=128, num_scheduler_steps=4)


def dense_guided_greedy(model, tokenizer, prompt: list[int], choices: list[str], eos_ids, max_tokens: int):
    """Greedy decoding of a dense forward where each step allows, by brute force over the
    vocabulary, the tokens whose bytes keep the output a prefix of some choice's, and
    end-of-sequence once it equals one."""
    targets = [choice.encode() for choice in choices]
    specials = {t for t, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    token_bytes = [b"" if t in specials else tokenizer.token_bytes(t) for t in range(len(tokenizer))]
    output, spelt = [], b""
    for _ in range(max_tokens):
        allowed = [t for t, data in enumerate(token_bytes)
                   if data and any(target.startswith(spelt + data) for target in targets)]
        if spelt in targets:
            allowed += list(eos_ids)
        logprobs = dense_logprobs(model, prompt + output)[-1]
        token = allowed[int(logprobs[allowed].argmax())]
        output.append(token)
        if token in eos_ids:
            break
        spelt += token_bytes[token]
    return output


def test_greedy_choice_equals_a_dense_brute_force_reference(llm, dense_model):
    tokenizer = llm.get_tokenizer()
    structured = StructuredOutputsParams(choice=CHOICES)
    prompts = ["Review: good. Sentiment:", "x", "def f(): return"]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=structured)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        [completion] = output.outputs
        expected = dense_guided_greedy(dense_model, tokenizer, tokenizer.encode(prompt), CHOICES,
                                       set(llm.engine.limits.eos_token_ids), 20)
        assert completion.token_ids == expected
        assert completion.text in CHOICES and completion.finish_reason == "stop"


def test_sampled_outputs_are_always_a_choice(llm):
    """Sampling at a high temperature over many seeds (n choices each) only ever spells choices, and
    reaches more than one of them."""
    params = SamplingParams(temperature=2.0, seed=3, n=8, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
    assert {c.finish_reason for o in outputs for c in o.outputs} == {"stop"}
    truncated = llm.generate("a", params.replace(max_tokens=1, n=1), use_tqdm=False)[0].outputs[0]
    assert truncated.finish_reason in ("length", "stop")
    assert any(choice.startswith(truncated.text) for choice in CHOICES)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.num_used_blocks == 0
    assert torch.get_num_threads() == 1


REGEXES = [
    r"-?(0|[1-9][0-9]{0,5})",
    r"(yes|no), because [a-z ]{3,20}\.",
    r'"[^"\\\n]{0,12}"',
    r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,3} years old",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_sampled_outputs_match_the_regex(llm, pattern):
    """Sampled at a high temperature, every output that ends with end-of-sequence is a whole match
    by Python's `re`; one cut short by max_tokens is a prefix some match begins with."""
    params = SamplingParams(temperature=1.5, seed=1, n=6, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    completions = [c for o in llm.generate(["a", "The answer:"], params, use_tqdm=False) for c in o.outputs]
    dfa = ByteDFA(pattern)
    for completion in completions:
        if completion.finish_reason == "stop":
            assert re.fullmatch(pattern, completion.text, re.ASCII), completion.text
        else:
            state = dfa.start
            for byte in completion.text.encode():
                state = dfa.step(state, byte)
                assert state is not None, completion.text
    assert any(c.finish_reason == "stop" for c in completions)


PET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["cat", "dog", "fish"]},
    "vaccinated": {"type": "boolean"}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "weight": {"type": "number", "exclusiveMinimum": 0, "maximum": 9.5},
    "owner": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": '^[a-z"]{1,4}$'}]}},
    "required": ["name", "kind", "vaccinated", "age", "weight"]}


JSON_CONSTRAINTS = [StructuredOutputsParams(json=PET), StructuredOutputsParams(json_object=True)]


@pytest.mark.parametrize("structured", JSON_CONSTRAINTS, ids=["json schema", "json_object"])
def test_sampled_outputs_are_valid_json(llm, structured):
    """Under a JSON schema every output that ends with end-of-sequence parses and validates (by
    `jsonschema`); under json_object it is a JSON object; one cut short is a prefix of a match."""
    jsonschema = pytest.importorskip("jsonschema")
    params = SamplingParams(temperature=1.0, seed=2, n=6, max_tokens=60, structured_outputs=structured)
    completions = [c for o in llm.generate(["a", "{"], params, use_tqdm=False) for c in o.outputs]
    dfa = ByteDFA(structured.pattern)
    for completion in completions:
        if completion.finish_reason == "stop":
            value = json.loads(completion.text)
            if structured.json is not None:
                jsonschema.validate(value, PET)
            assert isinstance(value, dict)
        else:
            state = dfa.start
            for byte in completion.text.encode():
                state = dfa.step(state, byte)
                assert state is not None, completion.text
    if structured.json is not None:
        assert any(c.finish_reason == "stop" for c in completions)


def test_a_model_without_an_end_of_sequence_token_refuses_structured_outputs(model_dir, tmp_path):
    """A match ends with end-of-sequence; a model that names none gets a ValueError, not a
    request that can never end."""
    import shutil

    shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
    for name, keys in (("config.json", ("eos_token_id",)), ("generation_config.json", ("eos_token_id",)),
                       ("tokenizer_config.json", ("eos_token",))):
        values = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({k: v for k, v in values.items() if k not in keys}))
    llm = LLM(tmp_path, max_model_len=64)
    assert llm.engine.limits.eos_token_ids == ()
    with pytest.raises(ValueError, match="structured_outputs need an end-of-sequence token"):
        llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x"])),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# Grammars with no forced bytes (a literal of several characters is forced after its first, where
# llguidance allows only the tokens that spell the rest canonically), so that a token is allowed
# exactly when its bytes continue a sentence, as the regex guide allows it.
GRAMMARS_AS_REGEXES = [
    ('root ::= [a-z]+ " " [0-9]+', "[a-z]+ [0-9]+"),
    ('start: /[a-z0-9]+/ ("." /[a-z_]+/)*', r"[a-z0-9]+(?:\.[a-z_]+)*"),  # Lark
]


@pytest.mark.parametrize("grammar, regex", GRAMMARS_AS_REGEXES)
def test_a_regular_grammar_gives_the_regex_guides_greedy_tokens(llm, grammar, regex):
    """Two independent implementations, llguidance's Earley parser and the byte automaton, agree
    token for token on grammars whose language a regex also writes."""
    pytest.importorskip("llguidance")
    prompts = ["def f(x):", "import os", "class A:", "    return", "x = 1", "#"]
    by_grammar, by_regex = (
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, structured_outputs=structured),
                     use_tqdm=False)
        for structured in (StructuredOutputsParams(grammar=grammar), StructuredOutputsParams(regex=regex)))
    for a, b in zip(by_grammar, by_regex, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(regex, a.outputs[0].text) or a.outputs[0].finish_reason == "length"


ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'


def arithmetic_prefix_end(text: str, position: int = 0) -> int:
    """Where the expression at `position` ends (a recursive-descent recognizer of ARITHMETIC),
    len(text) + 1 where the text ends inside it; a ValueError where the text breaks the grammar."""
    def term(i: int) -> int:
        if i == len(text):
            return len(text) + 1
        if text[i].isdigit():
            return i + 1
        if text[i] != "(":
            raise ValueError(text)
        i = expr(i + 1)
        if i >= len(text):
            return len(text) + 1
        if text[i] != ")":
            raise ValueError(text)
        return i + 1

    def expr(i: int) -> int:
        i = term(i)
        while i < len(text) and text[i] == "+":
            i = term(i + 1)
        return i

    return expr(position)


def test_sampled_outputs_are_sentences_of_a_context_free_grammar(llm):
    """Balanced parentheses, which no regex can count: every output that ends with
    end-of-sequence is a sentence, every one cut short a prefix of one."""
    pytest.importorskip("llguidance")
    params = SamplingParams(temperature=1.0, seed=3, n=8, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(grammar=ARITHMETIC))
    completions = [c for o in llm.generate(["x = ", "("], params, use_tqdm=False) for c in o.outputs]
    for completion in completions:
        end = arithmetic_prefix_end(completion.text)
        if completion.finish_reason == "stop":
            assert end == len(completion.text), completion.text
        else:
            assert end == len(completion.text) + 1 or end == len(completion.text), completion.text
    assert any(c.finish_reason == "stop" and "(" in c.text for c in completions)


def test_without_llguidance_a_grammar_or_what_the_automaton_cannot_hold_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ValueError, match=r"needs the llguidance package: pip install 'slipstream\[grammar"):
        StructuredOutputsParams(grammar='root ::= "never compiled before"')
    with pytest.raises(ValueError, match="multipleOf cannot be enforced .*the optional llguidance package"):
        StructuredOutputsParams(json={"type": "integer", "multipleOf": 3})


BEYOND_THE_AUTOMATON = {"type": "object", "properties": {
    "count": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "tags": {"type": "object", "patternProperties": {"^[a-z]{1,3}$": {"type": "boolean"}}, "maxProperties": 2,
             "additionalProperties": False}},
    "required": ["count", "tags"], "additionalProperties": False}


def test_a_schema_the_automaton_cannot_hold_goes_to_llguidance(llm):
    """multipleOf and patternProperties, which the regex writer refuses, are enforced by
    llguidance's JSON Schema compiler (vLLM's fallback from xgrammar to guidance): every output
    that ends validates under `jsonschema`."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    structured = StructuredOutputsParams(json=BEYOND_THE_AUTOMATON)
    assert structured.guide_key[0] == "llguidance"
    assert StructuredOutputsParams(json=PET).guide_key[0] == "regex"
    params = SamplingParams(temperature=1.0, seed=4, n=6, max_tokens=60, structured_outputs=structured)
    completions = [c for o in llm.generate(["a", "{"], params, use_tqdm=False) for c in o.outputs]
    finished = [json.loads(c.text) for c in completions if c.finish_reason == "stop"]
    for value in finished:
        jsonschema.validate(value, BEYOND_THE_AUTOMATON)
    assert finished



def test_a_pattern_matches_the_whole_string_whichever_enforces_it(llm):
    """The byte automaton reads a string `pattern` as a match of the whole value (vLLM's backends'
    reading) and llguidance as a search (JSON Schema's); the fallback anchors patterns so that a
    schema means one thing either way: every finished output's string matches whole."""
    pytest.importorskip("llguidance")
    pattern = "[a-c]{2}x"
    for extra in ({}, {"multipleOf": 5}):
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 99,
                                                         **extra}},
                  "required": ["s", "n"], "additionalProperties": False}
        structured = StructuredOutputsParams(json=schema)
        assert structured.guide_key[0] == ("llguidance" if extra else "regex")
        params = SamplingParams(temperature=1.0, seed=7, n=8, max_tokens=60, structured_outputs=structured)
        [output] = llm.generate(["{"], params, use_tqdm=False)
        finished = [json.loads(c.text) for c in output.outputs if c.finish_reason == "stop"]
        assert finished
        for value in finished:
            assert re.fullmatch(pattern, value["s"]), value


def test_a_schema_nested_past_pythons_stack_is_a_value_error():
    """The parsers and writers recurse once per level: past Python's stack that is a ValueError
    naming the field (a RecursionError was a 500), whatever the nesting."""
    schema = functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(3000),
                              {"type": "integer"})
    with pytest.raises(ValueError, match="structured_outputs.json nests too deeply to compile"):
        StructuredOutputsParams(json=schema)


def test_a_grammar_that_strands_ends_the_output_with_a_warning(model_dir, caplog):
    """llguidance finds no token that goes on after "a" (the rule `x` never ends): computing the
    mask leaves its matcher in error, which the guide notices after that computation too (before,
    it handed the sampler the mask llguidance left, as if the output could go on), logs and ends
    the output with the end-of-sequence tokens."""
    pytest.importorskip("llguidance")
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.serve.structured import GrammarGuide, compile_grammar, grammar_tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    eos = [tokenizer.eos_token_id]
    guide = GrammarGuide(compile_grammar('start: "a" x\nx: x "b"'),
                         grammar_tokenizer(tokenizer.backend, len(tokenizer), eos), len(tokenizer), eos)
    matcher = guide.start
    [a] = tokenizer.encode("a", add_special_tokens=False)
    assert guide.allowed_token_ids(matcher)[a]
    matcher = guide.advance(matcher, a)
    with caplog.at_level(logging.WARNING, logger="slipstream.serve.structured"):
        assert list(guide.allowed_token_ids(matcher)) == eos
    assert "llguidance stopped" in caplog.text
