"""Structured outputs: constrain generation to one of a set of strings (vLLM's `choice`). Plain Python.

The output must spell one of the choices byte for byte, then end. The choices' UTF-8 bytes form a
trie; the tokenizer's tokens (their bytes, special tokens left out) form another. At a node of the
choice trie, a token is allowed when its bytes walk on from that node inside the choice trie (one
walk over both tries at once finds them) to a node from which a choice can still be completed;
the end-of-sequence tokens are allowed where a choice is complete. Each node's allowed tokens are
computed when the request is added.

Token bytes are those each token decodes to alone (`Tokenizer.token_bytes`), exact for byte-level
BPE (GPT-2, Llama 3, Qwen and slipstream's own tokenizers), so a choice may be spelt by any of
the token sequences that make up its bytes, split characters included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`; of its constraints slipstream implements `choice`."""

    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        for name in ("json", "regex", "grammar", "json_object"):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"structured_outputs.{name} is not supported (slipstream implements "
                                 "choice, without a grammar library to compile the others)")
        if self.choice is None:
            raise ValueError("structured_outputs needs choice, a list of strings")
        if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence) or not all(
                isinstance(c, str) and c for c in self.choice) or not self.choice:
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        object.__setattr__(self, "choice", tuple(self.choice))


class _Node:
    __slots__ = ("children", "token_ids", "is_end", "allowed")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.token_ids: list[int] = []
        """Vocabulary trie: the tokens whose bytes end here."""
        self.is_end = False
        """Choice trie: a choice ends here."""
        self.allowed: list[int] = []
        """Choice trie: the tokens allowed here (empty where no choice can be completed)."""

    def child(self, byte: int) -> _Node:
        node = self.children.get(byte)
        if node is None:
            node = self.children[byte] = _Node()
        return node


class Vocabulary:
    """The tokenizer's tokens as a byte trie (built once per engine, on first use)."""

    def __init__(self, token_bytes: Sequence[bytes | None]) -> None:
        """`token_bytes[i]` is token i's bytes; None (a special token) or b"" leaves it out."""
        self.token_bytes = list(token_bytes)
        self.root = _Node()
        for token_id, data in enumerate(token_bytes):
            if data:
                node = self.root
                for byte in data:
                    node = node.child(byte)
                node.token_ids.append(token_id)


class ChoiceGuide:
    """One prompt's constraint (shared by its `n` completions): a completion's state is the
    choice-trie node its output has reached, `root` at first, None once it has left the choices
    (with an end-of-sequence token).

    A token is allowed only where it leads to a node from which a choice can still be completed
    with the vocabulary's tokens, so the output never strands part-way (a byte no token starts
    with, say); all nodes' allowed tokens are computed when the guide is built, deepest first."""

    def __init__(self, choices: Sequence[str], vocabulary: Vocabulary, eos_token_ids: Sequence[int]) -> None:
        """A ValueError when no choice can be spelt with the vocabulary's tokens."""
        self.root = _Node()
        self._vocabulary = vocabulary
        self._eos_token_ids = sorted(set(eos_token_ids))
        depths = {id(self.root): 0}
        nodes = [self.root]
        for choice in choices:
            node = self.root
            for depth, byte in enumerate(choice.encode(), start=1):
                node = node.child(byte)
                if id(node) not in depths:
                    depths[id(node)] = depth
                    nodes.append(node)
            node.is_end = True
        for node in sorted(nodes, key=lambda n: depths[id(n)], reverse=True):  # tokens only go deeper
            allowed = {token_id for token_ids, target in self._transitions(node)
                       if target.allowed or target.is_end for token_id in token_ids}
            if node.is_end:
                allowed.update(self._eos_token_ids)
            node.allowed = sorted(allowed)
        if not self.root.allowed:
            raise ValueError(f"structured_outputs.choice: no choice can be spelt with this tokenizer's "
                             f"tokens (choices {list(choices)!r})")

    def _transitions(self, state: _Node) -> list[tuple[list[int], _Node]]:
        """(tokens, node they lead to) for every vocabulary token whose bytes walk on from `state`
        inside the choice trie: one walk over both tries at once."""
        transitions = []
        pending = [(state, self._vocabulary.root)]
        while pending:
            choice_node, vocab_node = pending.pop()
            for byte, choice_child in choice_node.children.items():
                vocab_child = vocab_node.children.get(byte)
                if vocab_child is not None:
                    if vocab_child.token_ids:
                        transitions.append((vocab_child.token_ids, choice_child))
                    pending.append((choice_child, vocab_child))
        return transitions

    def allowed_token_ids(self, state: _Node | None) -> list[int]:
        """The tokens that may come next at `state`: those that keep the output on a choice it can
        still complete, and the end-of-sequence ids where a choice is complete (or the output has
        left the choices)."""
        return self._eos_token_ids if state is None else state.allowed

    def advance(self, state: _Node | None, token_id: int) -> _Node | None:
        """The state after `token_id`; None off every choice (an end-of-sequence token)."""
        token_bytes = self._vocabulary.token_bytes
        data = token_bytes[token_id] if token_id < len(token_bytes) else None
        if not data:
            return None
        for byte in data:
            if state is None:
                return None
            state = state.children.get(byte)
        return state
