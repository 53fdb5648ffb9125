"""Regular expressions as byte automata (slipstream/serve/fsm.py), checked against Python's `re`:
the automaton accepts the UTF-8 of a text exactly when `re.fullmatch(pattern, text, re.ASCII)`
matches it, on texts hypothesis draws from the pattern and on random ones."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.serve.fsm import ByteDFA, utf8_sequences

PATTERNS = [
    r"positive|negative|neutral",
    r"[0-9]{3}-[0-9]{4}",
    r"\d+(\.\d+)?([eE][+-]?\d+)?",
    r"-?(0|[1-9]\d*)",
    r"[A-Za-z_][A-Za-z0-9_]*",
    r'"([^"\\]|\\["\\/bfnrt])*"',
    r"(ab|a)*b?",
    r"a{2,4}b{3}c{0,2}d{2,}",
    r"(?:yes|no)(, (?:yes|no))*",
    r"(?P<word>\w+)\s+\W?",
    r"[^a-z]{1,3}",
    r".{0,5}x",
    r"[€😀é-ü]+\u00e9?",
    r"\x41\u0042\.\[\]\(\)\{\}\*\+\?\|\^\$\\",
    r"^(true|false)$",
    r"[\d\s-]*",
    r"(a|b|)c*?",
    r"{}x{,2}",
    r"a{,}b{1,x}c{²}",
    r"",
]

ALPHABET = st.sampled_from(list("abcdexyzABZ019_-+.,'\"\\/ \t\n€😀éü{}[]()|*?^$EeP"))


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_automaton_accepts_what_re_fullmatch_matches(pattern, data):
    dfa = ByteDFA(pattern)
    matching = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True), label="matching")
    assert dfa.matches(matching.encode()), matching
    other = data.draw(st.text(ALPHABET, max_size=12), label="other")
    assert dfa.matches(other.encode()) == bool(re.fullmatch(pattern, other, re.ASCII)), other


def test_prefixes_stay_alive_exactly_while_a_match_can_follow():
    """`step` returns None as soon as no continuation of the bytes can match, and never before."""
    dfa = ByteDFA(r"ab*c")
    state = dfa.start
    for byte in b"abbb":
        state = dfa.step(state, byte)
        assert state is not None and not dfa.accepts(state)
    assert dfa.step(state, ord("x")) is None
    assert dfa.accepts(dfa.step(state, ord("c")))
    assert dfa.step(dfa.step(state, ord("c")), ord("c")) is None
    euro = ByteDFA("€")  # e2 82 ac: the first two bytes are live, a wrong third is not
    state = dfa_walk(euro, b"\xe2\x82")
    assert state is not None and euro.step(state, 0xAD) is None


def dfa_walk(dfa: ByteDFA, data: bytes):
    state = dfa.start
    for byte in data:
        state = dfa.step(state, byte)
    return state


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "backreferences are not supported"),
    (r"a(?=b)", "lookaround, flags, backreferences"),
    (r"(?i)abc", "lookaround, flags, backreferences"),
    (r"\bword\b", "word boundaries are not supported"),
    (r"a++", "possessive quantifiers are not supported"),
    (r"a|b$c", "supported only at the pattern's ends"),
    (r"(ab", "missing"),
    (r"ab)", "unbalanced"),
    (r"*a", "nothing to repeat"),
    (r"[z-a]", "bad character range"),
    (r"a{3,2}", "min repeat greater than max repeat"),
    (r"\q", "unknown escape"),
    (r"[^\x00-\U0010ffff]", "matches no text"),
    (r"(a{1,200}){1,400}", "regex too large"),
    ("(" * 5000 + "a" + ")" * 5000, "groups nest deeper than 100 levels"),  # a RecursionError, a 500
    # a run of quantifiers nests the tree once per quantifier (1,000 were a RecursionError, a 500)
    ("a" + "*" * 1000, "at position 102: groups and quantifiers in a row nest deeper than 100 levels"),
    ("a" + "{0,1}" * 1000, "groups and quantifiers in a row nest deeper than 100 levels"),
    ("(" * 60 + "a" + "*" * 41 + ")" * 60, "groups and quantifiers in a row nest deeper than 100 levels"),
])
def test_what_the_automaton_cannot_express_is_a_value_error(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ByteDFA(pattern)


@pytest.mark.parametrize("pattern, grouped", [
    ("a**", "(?:a*)*"), ("a{2}{3}", "(?:a{2}){3}"), ("a{0,1}{0,1}", "(?:a?)?"), ("a*??", "(?:a*?)?"),
    ("a+*", "(?:a+)*"), ("a{,}*", "(?:a*)*"), ("(?:ab|c)?*", "(?:(?:ab|c)?)*"),
])
def test_a_repeated_repeat_matches_as_the_grouped_one(pattern, grouped):
    """Python's re calls these a multiple repeat, but vLLM serves them (llguidance takes them): each
    quantifier applies to what the one before made, as in the pattern with that grouped."""
    with pytest.raises(re.error, match="multiple repeat"):
        re.compile(pattern)
    dfa, reference = ByteDFA(pattern), re.compile(grouped, re.ASCII)
    for text in ("", "a", "aa", "aaaaaa", "aaaaaaa", "ab", "abab", "c", "abc", "b"):
        assert dfa.matches(text.encode()) == bool(reference.fullmatch(text)), (pattern, text)


@pytest.mark.parametrize("pattern", ["a*?", "a+?b", "a??", "a{1,2}?", "(a*)*", "(?:a{2}){3}", "a*{",
                                     "a{1,x}*"])
def test_a_lazy_quantifier_or_a_grouped_repeat_is_no_multiple_repeat(pattern):
    compiled = re.compile(pattern, re.ASCII)
    dfa = ByteDFA(pattern)
    for text in ("", "a", "aa", "aaaaaa", "ab", "a{", "a{,}", "a{,}a{,}"):
        assert dfa.matches(text.encode()) == bool(compiled.fullmatch(text)), (pattern, text)


def test_utf8_sequences_cover_exactly_the_code_points_of_a_range():
    """Every code point near the ranges' ends (and some at random) is encoded by one of the byte
    range sequences exactly when it is in the range; surrogates are no characters."""
    rng = random.Random(0)
    edges = [0, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF]
    for _ in range(200):
        low = rng.choice([*edges, rng.randrange(0x110000)])
        high = min(0x10FFFF, low + rng.choice([0, 1, 63, 64, 4095, 4096, 70000, rng.randrange(0x110000)]))
        sequences = utf8_sequences(low, high)
        probes = [*range(max(0, low - 66), min(0x110000, low + 66)),
                  *range(max(0, high - 66), min(0x110000, high + 66)),
                  *(rng.randrange(0x110000) for _ in range(40))]
        for code in probes:
            if not 0xD800 <= code <= 0xDFFF:
                data = chr(code).encode()
                encoded = any(len(s) == len(data)
                              and all(lo <= b <= hi for (lo, hi), b in zip(s, data, strict=True))
                              for s in sequences)
                assert encoded == (low <= code <= high), (hex(low), hex(high), hex(code))
