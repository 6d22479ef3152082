"""The vocabulary cut into id ranges, so one row's grammar mask is filled by several threads.

llguidance fills a row's mask by walking the token trie under the grammar's lexer.
Inside a JSON string bounded by `maxLength` its precomputed string slices do not
apply, and the walk visits nearly the whole 150k-token trie: 2-3 ms for one row
on the hosts we measured, longer than a whole 0.6B decode step, and one row
cannot be split across llguidance's threads (decision 0139). So each constrained
request also gets one matcher per part of the vocabulary: part k is an llguidance
tokenizer of the same size in which the tokens outside its id range are empty
(not in its trie, never allowed), so its walk visits about 1/parts of the trie,
and the row's mask is its parts' ranges put side by side.

The matcher of a part takes every sampled token: one of its own range as itself,
any other as the tokens of the part that spell the same bytes (the longest first;
every part keeps the single-byte tokens, so any token can be spelled). The grammar
reads bytes, so its state is the same either way. What is not the same: the
forced bytes of a state (a JSON key the schema fixes) are turned into their
canonical tokens through the trie, which differs per part; rows with forced bytes
are filled by the request's full matcher (`GrammarMatchers.start_bitmask`), and
their masks are single tokens or a prefix's few, cheap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import llguidance

_ENV = "KVPILOT_MASK_SPLIT"  # parts of the vocabulary per constrained row; 1: no split


def split_parts() -> int:
    """Gives how many parts to cut the vocabulary into for the mask fill: `KVPILOT_MASK_SPLIT`
    (unset or 1: no split); raises ValueError naming the variable when it is not an integer
    from 1 to 16.

    Off unless set: the parts cost CPU of their own (each takes every token, spelled, and
    fills its share with fixed costs of its own), so whether they pay off on a host and shape
    is what `bench/issue44/structured_lora.sh` measures on the GPU host (decision 0139)."""
    raw = os.environ.get(_ENV, "") or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise ValueError(f"{_ENV}={raw!r} is not a number of vocabulary parts: set an integer "
                         "from 1 (no split) to 16, or unset it")
    return int(raw)


class _PartTokenizer:
    """The token bytes llguidance builds a part's tokenizer from (its `TokenizerWrapper`
    protocol); text is tokenized as the whole vocabulary does it."""

    is_tokenizer_wrapper = True

    def __init__(self, tokens: list[bytes], specials: list[int], eos: int,
                 full: llguidance.LLTokenizer) -> None:
        self.tokens = tokens
        self.special_token_ids = specials
        self.eos_token_id = eos
        self.bos_token_id = None
        self._full = full

    def __call__(self, text: str) -> list[int]:
        return self._full.tokenize_str(text)


class VocabSplit:
    """The vocabulary's parts: their id ranges, tokenizers, and how each spells any token."""

    def __init__(self, full: llguidance.LLTokenizer, vocab_size: int, eos: Sequence[int],
                 parts: int) -> None:
        token_bytes = [full.decode_bytes([i]) for i in range(vocab_size)]
        specials = [i for i in range(vocab_size) if full.is_special_token(i)]
        special = set(specials)
        self._single = {b[0]: i for i, b in enumerate(token_bytes)
                        if len(b) == 1 and i not in special}
        spelled = {byte for i, b in enumerate(token_bytes) if i not in special for byte in b}
        missing = spelled - self._single.keys()
        if missing:
            raise ValueError(f"the vocabulary has no single-byte token for {len(missing)} "
                             "byte(s): its parts could not spell every token")
        # ranges on 32-token boundaries: each part owns whole words of the mask
        self.bounds = [round(vocab_size * k / parts / 32) * 32 for k in range(parts)]
        self.bounds.append(vocab_size)
        self.words = [(self.bounds[k] // 32, -(-self.bounds[k + 1] // 32))
                      for k in range(parts)]
        singles = set(self._single.values())
        self._bytes = token_bytes
        self._own: list[dict[bytes, int]] = []
        self.tokenizers: list[llguidance.LLTokenizer] = []
        for lo, hi in zip(self.bounds, self.bounds[1:], strict=False):
            kept = [b if lo <= i < hi or i in singles else b"" for i, b in enumerate(token_bytes)]
            own = {b: i for i, b in enumerate(kept[lo:hi], lo) if b and i not in special}
            own.update((bytes([byte]), i) for byte, i in self._single.items())
            self._own.append(own)
            self.tokenizers.append(llguidance.LLTokenizer(
                _PartTokenizer(kept, specials, eos[0], full),  # pyright: ignore[reportArgumentType]
                n_vocab=vocab_size, eos_token=list(eos)))
        self._longest = [max(map(len, own)) for own in self._own]
        self._spellings: list[dict[int, list[int]]] = [{} for _ in range(parts)]
        self._special = special

    @property
    def parts(self) -> int:
        return len(self.tokenizers)

    def spelling(self, part: int, token: int) -> list[int]:
        """Gives the tokens of `part` whose bytes are `token`'s: `[token]` when the part has it
        (its range, a single byte, a special token), else the longest of the part's own
        tokens first (cached)."""
        cache = self._spellings[part]
        found = cache.get(token)
        if found is not None:
            return found
        lo, hi = self.bounds[part], self.bounds[part + 1]
        data = self._bytes[token]
        if lo <= token < hi or token in self._special or len(data) <= 1:
            found = [token]
        else:
            own, longest, found, i = self._own[part], self._longest[part], [], 0
            while i < len(data):
                for n in range(min(longest, len(data) - i), 0, -1):
                    piece = own.get(data[i:i + n])
                    if piece is not None:
                        found.append(piece)
                        i += n
                        break
        cache[token] = found
        return found
