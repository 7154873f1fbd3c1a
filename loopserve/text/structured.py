"""Structured output: a request's output constrained to a JSON schema, a regular expression or
a list of choices, with llguidance (the optional `structured` extra).

llguidance (used by vLLM, SGLang and llama.cpp; a Rust library with CPU wheels and no torch
dependency) compiles the constraint into a grammar, and a per-request matcher gives, before
each sampled token, the set of tokens that keep the output inside the grammar (a bit mask
over the vocabulary; when the output is complete, only the end tokens). The runner masks the
logits with it (`TokenHistory`) and the matcher consumes each token once it is final (never
a decode candidate that does not exit). This module is torch-free: the mask is a numpy array.

`StructuredOutputs` belongs to a model's tokenizer: it checks a request's constraint when the
request arrives (an invalid schema or regex is a 400 naming `response_format`) and makes the
matchers the runner asks for.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import StructuredOutput
from loopserve.text.tokenizer import Tokenizer

INSTALL_HINT = "structured output needs llguidance: pip install 'loopserve[structured]'"
PARAM = "response_format"


# JSON is written as `json.dumps` writes it (", " between items, ": " after keys, no other
# whitespace): a schema's output is then one text per value, and a small model cannot loop
# on whitespace (with any whitespace allowed, the demo model writes newlines until
# max_tokens). A schema may still ask for other settings in its "x-guidance" key.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def close_objects(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing of others closed
    (`additionalProperties: false`): what OpenAI's `strict` schemas must say, and what
    vLLM's guidance backend can assume (its `disable-additional-properties`). An open
    object lets a model add keys until `max_tokens`. Only subschemas are visited (not
    `enum`, `const` or `default` values)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [close_objects(item) for item in out[key]]
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(value) for name, value in out[key].items()}
    if isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (no tokenizer needed; checked by `check`)."""
    llguidance = _llguidance()
    if constraint.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(
            constraint.json_schema, defaults=JSON_OPTIONS
        )
    if constraint.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
    if constraint.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
    assert constraint.choice is not None
    alternatives = " | ".join(json.dumps(choice) for choice in constraint.choice)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


class GrammarMatcher:
    """One request's position in its grammar: the tokens allowed next (cached until the next
    token is consumed) and the tokens consumed so far."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._allowed: np.ndarray | None = None

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens that keep the output inside the grammar. Raises
        `InvalidRequestError` (param `response_format`) if the matcher is in an error state
        (no token is allowed then)."""
        if self._allowed is None:
            if self._matcher.is_error():
                # Grammars that compile can still meet llguidance's limits while the output
                # grows (2,001 choices in a row, a recursive required `$ref`, nested regex
                # repeats): the request's own input, reported as such (a 400, not a 500).
                raise InvalidRequestError(
                    f"structured output: {self._matcher.get_error()}", param=PARAM
                )
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            self._allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return self._allowed

    def consume(self, token_id: int) -> None:
        """A token became final. One the grammar does not allow (a stop token the request
        asked for, say) puts the matcher in its error state, reported by `allowed`."""
        self._matcher.consume_token(token_id)
        self._allowed = None

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


class StructuredOutputs:
    """Constraint checks and matchers for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None  # built on first use (needs llguidance)

    def _tokenizer(self) -> Any:
        if self._lltokenizer is None:
            llguidance = _llguidance()
            end_ids = (*self.tokenizer.eos_token_ids, *self.tokenizer.end_of_turn_token_ids)
            self._lltokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend_json(),
                n_vocab=self.vocab_size,
                eos_token=list(dict.fromkeys(end_ids)),
            )
        return self._lltokenizer

    def check(self, constraint: StructuredOutput, param: str = PARAM) -> None:
        """Raise `InvalidRequestError` (naming `param`: `response_format`, or `tools` for an
        enforced tool call) unless the constraint compiles for this tokenizer."""
        llguidance = _llguidance()
        try:
            grammar = grammar_of(constraint)
        except ValueError as err:  # not valid JSON
            raise InvalidRequestError(f"invalid JSON schema: {err}", param=param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error:
            raise InvalidRequestError(f"invalid {constraint.kind}: {error}", param=param)
        if constraint.json_schema is not None:
            # A schema whose language is empty (`{"$ref": "#"}` refers only to itself) lets
            # the output stop at once: an empty text, which is no JSON value.
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            matcher.compute_bitmask()  # the first token's mask tells whether it can go on
            if matcher.is_stopped():
                raise InvalidRequestError(
                    "invalid json_schema: it admits no JSON value (the only output it allows "
                    'is empty; a schema that refers only to itself, such as {"$ref": "#"}, '
                    "does this)",
                    param=PARAM,
                )

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_of(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {constraint.kind}: {matcher.get_error()}", PARAM)
        return GrammarMatcher(matcher, self.vocab_size)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(INSTALL_HINT, param=PARAM) from None
    return llguidance
