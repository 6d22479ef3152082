"""JSON schemas matched by xgrammar (`--structured-outputs-backend auto`, the default).

llguidance walks the token trie under its lexer for every mask: inside a JSON string
with `maxLength` its slices do not apply and one row walks nearly the whole vocabulary
(2-3 ms for 152k tokens, longer than a whole 0.6B decode step, decision 0139). xgrammar
precomputes, per grammar position, which tokens are allowed whatever the stack below
(its adaptive token-mask cache), so a row costs tens to hundreds of microseconds. vLLM's
default backend is xgrammar for the same reason. A step's rows are filled by
`BatchGrammarMatcher` on the engine's fill threads (`XgrammarMatchers.fill`, no GIL while
it runs), and its tokens accepted on one thread (`XgrammarMatchers.accept`).

xgrammar's batch calls start and join a new pool of threads on every call: ~0.5 ms for 15
threads on an H100 host (2026-12-06, `bench/results/issue44-xgrammar-pool-H100-2026-12-06`).
For the accept (a few microseconds a row) that start cost more than the rows: one thread
accepts 64 rows in 0.19 ms, 15 threads in 0.42. For the fill it does not: a pool of Python
threads made once, each taking the next row, filled 64 rows as fast alone (2.4 vs 2.2 ms)
and slower inside the engine (4.2-5.8 vs 2.6 ms a step): each row's return needs the GIL,
which the engine's thread holds while it books and schedules; fixed shares per thread with
one batch call each (one GIL round trip per thread) were in between (3.9 ms).

`auto` sends a request's `json` schema (and `json_object`) here and everything else to
llguidance: regexes, choices and Lark grammars (a dialect xgrammar does not read), and
schemas with keywords xgrammar does not enforce (`unsupported_keyword`), so no request
is matched more loosely than it asked. Both backends write no whitespace between JSON
tokens. xgrammar's strict mode gives an object without `additionalProperties` no
properties beyond those it names (vLLM's behaviour with xgrammar; llguidance allows
them). The API server checks every grammar with llguidance (`structured.grammar`), so a
schema is refused with the same 400 whichever backend matches it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams

# keywords xgrammar's JSON-schema converter leaves unenforced (their schemas go to llguidance)
_UNSUPPORTED = frozenset({"multipleOf", "uniqueItems", "contains", "minContains",
                          "maxContains", "patternProperties", "propertyNames",
                          "minProperties", "maxProperties", "dependentRequired",
                          "dependentSchemas", "if", "then", "else", "not",
                          "unevaluatedProperties", "unevaluatedItems", "format"})
# a string character in xgrammar's EBNF: as it writes it for bounded strings, and as JSON
# allows it unescaped
_BOUNDED_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'
# keys whose values are names, not schemas (a property called "format" is not the keyword)
_NAMES = frozenset({"properties", "$defs", "definitions"})


def unsupported_keyword(schema: Any) -> str | None:
    """Gives the first keyword of `schema` (a JSON schema, walked whole) that xgrammar does
    not enforce, None when it enforces them all."""
    if isinstance(schema, list):
        return next((k for item in schema if (k := unsupported_keyword(item))), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in _UNSUPPORTED:
            return key
        children = value.values() if key in _NAMES and isinstance(value, dict) else [value]
        if found := next((k for child in children if (k := unsupported_keyword(child))), None):
            return found
    return None


def xgrammar_schema(params: StructuredOutputsParams, backend: str) -> str | None:
    """Gives the JSON schema (text) that xgrammar matches for `params` under `backend`; None
    when llguidance matches it (backend `guidance`, a regex, choice or grammar, or a schema
    with a keyword xgrammar does not enforce)."""
    if backend != "auto":
        return None
    if params.json_object:
        return '{"type": "object"}'
    if params.json is None:
        return None
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    if unsupported_keyword(schema) is not None:
        return None
    return json.dumps(schema)


class XgrammarMatchers:
    """Compiles the schemas of one vocabulary into xgrammar matchers (the compiler caches
    each schema: a repeated schema compiles once, and its requests' matchers share it)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 threads: int) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._threads = threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._setup = threading.Lock()
        self._fill = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self._accept = xgrammar.BatchGrammarMatcher(max_threads=1)  # no thread starts

    def _compiler_of(self) -> xgrammar.GrammarCompiler:
        """Gives the vocabulary's compiler (~1 s for 150k tokens: once)."""
        with self._setup:
            if self._compiler is None:
                # xgrammar reads a vocabulary's encoding (byte-level, byte fallback, raw)
                # from a transformers tokenizer, here one around the model's tokenizer.json
                from tokenizers import Tokenizer
                from transformers import PreTrainedTokenizerFast
                tokenizer = PreTrainedTokenizerFast(
                    tokenizer_object=Tokenizer.from_str(self._tokenizer_json))
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._eos)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads)
            return self._compiler

    def matcher(self, schema: str, resumed: list[int]) -> xgrammar.GrammarMatcher:
        """Gives a matcher of `schema` advanced over `resumed` (a migrated request's output);
        raises ValueError when the schema does not compile or a resumed token is refused."""
        try:
            grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False,
                                                        separators=(",", ":"))
            # a length-bounded string's characters omit the control characters JSON forbids
            # unescaped (xgrammar 0.2.9 leaves them out of unbounded strings only): they would
            # make the output invalid JSON
            text = str(grammar).replace(_BOUNDED_CHARS, _JSON_CHARS)
            compiled = self._compiler_of().compile_grammar(xgrammar.Grammar.from_ebnf(text))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"does not compile: {exc}") from exc
        matcher = xgrammar.GrammarMatcher(compiled)
        for i, token in enumerate(resumed):
            if not matcher.accept_token(token):
                raise ValueError(f"refuses resume_token_ids[{i}]={token}")
        return matcher

    def fill(self, matchers: Sequence[xgrammar.GrammarMatcher], mask: torch.Tensor,
             rows: Sequence[int]) -> None:
        """Writes `matchers[i]`'s mask into row `rows[i]` of `mask` (int32, on the host) for
        every i, on the fill's threads (without the GIL)."""
        self._fill.batch_fill_next_token_bitmask(list(matchers), mask, list(rows))

    def accept(self, matchers: Sequence[xgrammar.GrammarMatcher], tokens: Sequence[int]
               ) -> list[bool]:
        """Advances `matchers[i]` by `tokens[i]` for every i, one after another on this thread
        (a few microseconds a row: fewer than starting threads for them); gives whether each
        took its token."""
        return self._accept.batch_accept_token(list(matchers), list(tokens))

    def allows_nothing(self, matcher: xgrammar.GrammarMatcher) -> bool:
        """Gives whether no token of the vocabulary can continue `matcher` (a grammar that
        needs text this tokenizer cannot spell): the explanation for a refused token, so
        called only then. A terminated matcher (it took EOS) refuses for that reason: False."""
        if matcher.is_terminated():
            return False
        mask = xgrammar.allocate_token_bitmask(1, self._vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        return not bool(mask.any())
