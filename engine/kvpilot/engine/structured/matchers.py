"""Per-request grammar matchers in the engine core, and the batch's token bitmask.

A request's JSON schema gets an xgrammar matcher under `--structured-outputs-backend
auto` (the default; `structured.xgrammar_backend` says which schemas, and why): its
rows are filled on xgrammar's threads before llguidance's, in the same background
fill, and it advances on one thread (`XgrammarMatchers.accept`). Everything else
(regexes, choices, Lark grammars; every constraint under `guidance`) is matched by
llguidance, as follows. A request with such a constraint gets an llguidance matcher: compiled in a
background thread when the request is added (~1-2 ms for a JSON schema on a 152k
vocabulary), waited for only when its first token is sampled. Each request
compiles its own: llguidance's `deep_copy` of a compiled matcher shares its
lexer behind one lock held for a whole mask, so copies of one schema filled
their rows one after another on any number of threads. Each step's mask has one
int32 row per sampled sequence (every bit set for rows without a constraint),
written into a reused host buffer (`structured.bitmask`) and copied to the
device without waiting. `start_bitmask` hands the fill to a background thread,
which runs llguidance's parallel executor on one thread per CPU this process may
use but one (the engine's own thread goes on meanwhile; llguidance's default, 80%
of them, is one thread on two) and holds no GIL. One row's walk cannot be shared
by llguidance's threads, and in a length-bounded JSON string it outlasts a whole
0.6B decode step: with the vocabulary split (`structured.vocab_split`), each
request also gets a matcher per part of the vocabulary (compiled beside its own,
in parallel), and a row without forced bytes is filled by its parts, each walking
its share of the trie on a thread of its own. Under async scheduling the
engine starts it once the previous step's tokens were accepted, books that step
and schedules the next while it runs (the GPU runs the forward), and waits for it
only to queue the sampling (`MaskFill.wait`). `bitmask` fills and waits at once.
The sampler applies the whole batch's mask in one select. `accept_tokens` advances
a batch's matchers (and parts) by their sampled tokens on llguidance's threads. A grammar that fails in the core (the API server
checked it, so this is a library fault) sets the request's error and allows only
EOS, so the request ends at once and its reader gets the error. Matcher state
follows the output tokens, which survive preemption (recompute keeps them), so
nothing is rolled back there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
import xgrammar

from kvpilot.engine.structured.bitmask import BitmaskBuffer
from kvpilot.engine.structured.grammar import grammar_of
from kvpilot.engine.structured.vocab_split import VocabSplit, split_parts
from kvpilot.engine.structured.xgrammar_backend import XgrammarMatchers, xgrammar_schema

if TYPE_CHECKING:
    from kvpilot.engine.core.request import Request, Sequence

log = logging.getLogger(__name__)
_MAX_FILL_THREADS = 32  # llguidance's own cap
# why a request whose grammar no token of the vocabulary can continue failed (its mask row
# was empty, so the sampler's token was refused)
NOTHING_ALLOWED = ("allows no token of this model's vocabulary here: the grammar needs text "
                   "the tokenizer cannot spell")
Matcher = llguidance.LLMatcher | xgrammar.GrammarMatcher


def fill_threads() -> int:
    """Gives the parallel mask fill's thread count: the CPUs this process may use but the one
    the engine's own thread keeps working on meanwhile, at least 1, at most 32."""
    return max(1, min(len(os.sched_getaffinity(0)) - 1, _MAX_FILL_THREADS))


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """Gives a freshly compiled matcher of `grammar` (never a `deep_copy`: copies share one
    locked lexer, so their masks cannot be filled in parallel); raises ValueError when the
    grammar does not compile."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


class GrammarMatchers:
    """Compiles and advances the grammar matchers of constrained requests."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 device: torch.device, backend: str = "auto") -> None:
        self._backend = backend
        self._xgrammar: XgrammarMatchers | None = None  # on the first schema it matches
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._parts = split_parts()
        self._split: VocabSplit | None = None  # built on first use, when `_parts` > 1
        self._setup = threading.Lock()  # the compile threads build the tokenizers once
        # compiling drops the GIL: a request's matcher and its parts compile side by side
        self._pool = ThreadPoolExecutor(self._parts if self._parts > 1 else 1,
                                        thread_name_prefix="kvpilot-grammar")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-mask")
        self._executor: llguidance.LLExecutor | None = None
        num_words = (vocab_size + 31) // 32  # one bit per token
        self._buffer = BitmaskBuffer(num_words, device)
        self._scratch = torch.empty(0, num_words, dtype=torch.int32)  # the parts' full rows
        self.fill_seconds = 0.0  # of the last fill (the slow-iteration log's "grammar")
        self.split_rows = 0  # rows filled by their vocabulary parts so far (the bench's count)
        words = np.zeros(num_words, dtype=np.uint32)
        for eos in self._eos:
            words[eos // 32] |= np.uint32(1 << (eos % 32))
        self._eos_only = torch.from_numpy(words.view(np.int32))  # a failed grammar's row

    def add(self, request: Request) -> None:
        """Starts compiling `request`'s matcher in the background (the API server checked the
        grammar; one that fails here ends the request with an error)."""
        params = request.params.structured_outputs
        if params is None:
            return
        resumed = request.params.resume_token_ids or []
        schema = xgrammar_schema(params, self._backend)
        if schema is not None:
            request.grammar = self._pool.submit(self._xgrammar_of().matcher, schema, resumed)
            return
        grammar = grammar_of(params)
        request.grammar = self._pool.submit(self._matcher, grammar, resumed)
        # a Lark grammar may count tokens (max_tokens) or end lazily: its parts, which take
        # a token as several, could disagree with it
        if self._parts > 1 and params.grammar is None:
            request.grammar_parts = self._pool.submit(self._part_matchers, grammar, resumed)

    def _xgrammar_of(self) -> XgrammarMatchers:
        """Gives the xgrammar side (its compiler is built on the first schema's compile)."""
        if self._xgrammar is None:
            self._xgrammar = XgrammarMatchers(self._tokenizer_json, self._vocab_size,
                                              self._eos, fill_threads())
        return self._xgrammar

    def _full_tokenizer(self) -> llguidance.LLTokenizer:
        """Gives the vocabulary's llguidance tokenizer (~1 s for 150k tokens: once)."""
        with self._setup:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def _vocab_split(self) -> VocabSplit:
        """Gives the vocabulary's parts (a tokenizer each, ~0.3 s apiece: once); raises
        ValueError when some byte has no single-byte token to spell tokens with."""
        full = self._full_tokenizer()
        with self._setup:
            if self._split is None:
                self._split = VocabSplit(full, self._vocab_size, self._eos, self._parts)
            return self._split

    def _part_matchers(self, grammar: str, resumed: list[int]) -> list[llguidance.LLMatcher]:
        """Gives a matcher of `grammar` per part of the vocabulary, advanced over `resumed`;
        none (the full matcher fills the row alone) when the parts cannot be made."""
        try:
            split = self._vocab_split()
            parts = [new_matcher(tok, grammar) for tok in split.tokenizers]
        except ValueError as exc:
            log.warning("structured outputs: the mask is not split (%s)", exc)
            return []
        for k, matcher in enumerate(parts):
            spelled = [piece for token in resumed for piece in split.spelling(k, token)]
            if spelled and not matcher.consume_tokens(spelled):
                return []  # the full matcher refuses it too and fails the request
        return parts

    def _matcher(self, grammar: str, resumed: list[int]) -> llguidance.LLMatcher:
        """Gives a matcher of `grammar`, compiled for this request and advanced over the
        output another engine already sent (a migrated request's `resume_token_ids`)."""
        tokenizer = self._full_tokenizer()
        try:
            matcher = new_matcher(tokenizer, grammar)
        except ValueError as exc:
            raise ValueError(f"does not compile: {exc}") from exc
        for i, token in enumerate(resumed):
            if not matcher.consume_token(token):
                raise ValueError(f"refuses resume_token_ids[{i}]={token}: "
                                 f"{matcher.get_error()}")
        return matcher

    @staticmethod
    def _resolved(request: Request) -> Matcher | None:
        """Gives `request`'s matcher once compiled; None once its grammar failed (the request
        then carries the error and may only end)."""
        grammar = request.grammar
        if isinstance(grammar, Future):
            try:
                grammar = request.grammar = grammar.result()
            except ValueError as exc:  # a grammar that does not compile, or a resume it refuses
                grammar = request.grammar = _fail(request, str(exc))
        return grammar if isinstance(grammar, llguidance.LLMatcher | xgrammar.GrammarMatcher) \
            else None

    def _ready_parts(self, request: Request) -> list[llguidance.LLMatcher]:
        """Gives `request`'s part matchers once compiled and level with its full matcher,
        without waiting for them (empty: the full matcher fills the row alone). Parts that
        finished compiling take the tokens accepted meanwhile first (once per request)."""
        parts = request.grammar_parts
        if isinstance(parts, Future):
            if not parts.done():
                return []
            parts = request.grammar_parts = parts.result()
            pending, request.grammar_pending = request.grammar_pending, []
            split = self._split
            for k, matcher in enumerate(parts):
                assert split is not None  # the parts were made from it
                spelled = [p for token in pending for p in split.spelling(k, token)]
                if spelled and not matcher.consume_tokens(spelled):
                    self._drop_parts(request)
                    return []
        return parts

    @staticmethod
    def _drop_parts(request: Request) -> None:
        """Fills `request`'s rows whole from now on: one of its parts refused a token its full
        matcher took (a library fault, logged)."""
        log.warning("request %s: a vocabulary part's matcher refused a token the full one "
                    "took; its mask is filled whole from now on", request.request_id)
        request.grammar_parts = []

    def _fill_executor(self) -> llguidance.LLExecutor:
        """Gives llguidance's parallel executor (made on first use)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(fill_threads())
        return self._executor

    def start_bitmask(self, seqs: list[Sequence]) -> MaskFill | None:
        """Starts filling the [len(seqs), ceil(vocab / 32)] int32 mask of allowed tokens on a
        background thread, or gives None when no sequence is constrained; a failed grammar's
        row allows only EOS, a finished sequence's row (its token is discarded) allows all.
        The matchers must not move until the fill was waited for."""
        self.fill_seconds = 0.0
        rows = [(s.request, row) for row, s in enumerate(seqs)
                if s.request.grammar is not None and not s.finished]
        if not rows:
            return None
        mask = self._buffer.rows(len(seqs))
        constrained: list[tuple[llguidance.LLMatcher, int]] = []
        split_rows: list[tuple[list[llguidance.LLMatcher], int]] = []
        schemas: list[tuple[xgrammar.GrammarMatcher, int]] = []
        for request, row in rows:
            matcher = self._resolved(request)  # waits here for a grammar still compiling
            if matcher is None:
                mask[row] = self._eos_only
            elif isinstance(matcher, xgrammar.GrammarMatcher):
                if matcher.is_terminated():  # took EOS: its token is discarded
                    mask[row] = self._eos_only
                else:
                    schemas.append((matcher, row))
            # forced bytes become canonical tokens through the trie, which differs per part
            elif (parts := self._ready_parts(request)) and not matcher.compute_ff_bytes():
                split_rows.append((parts, row))
            else:
                constrained.append((matcher, row))
        self.split_rows += len(split_rows)
        if not constrained and not split_rows and not schemas:
            return MaskFill(self._buffer, mask, None)
        # the fill thread needs the GIL to start, and a thread waiting for it gets it only
        # when this one blocks or after the 5 ms switch interval: without this handshake the
        # fill began only at `MaskFill.wait`, in series with the step's host work
        started = threading.Event()
        filling = self._fill_pool.submit(self._started_fill, started, constrained, split_rows,
                                         schemas, mask)
        started.wait()
        return MaskFill(self._buffer, mask, filling)

    def bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Gives the mask `start_bitmask` fills, on the device (copied without waiting)."""
        fill = self.start_bitmask(seqs)
        return fill.wait() if fill is not None else None

    def _started_fill(self, started: threading.Event,
                      constrained: list[tuple[llguidance.LLMatcher, int]],
                      parts: list[tuple[list[llguidance.LLMatcher], int]],
                      schemas: list[tuple[xgrammar.GrammarMatcher, int]], mask: torch.Tensor
                      ) -> None:
        """Lets `start_bitmask` return, then fills: this thread keeps the GIL until the
        fill drops it."""
        started.set()
        begun = time.perf_counter()
        self._fill(constrained, parts, schemas, mask)
        self.fill_seconds = time.perf_counter() - begun

    def _fill(self, constrained: list[tuple[llguidance.LLMatcher, int]],
              parts: list[tuple[list[llguidance.LLMatcher], int]],
              schemas: list[tuple[xgrammar.GrammarMatcher, int]], mask: torch.Tensor) -> None:
        """Writes the constrained rows of `mask` (on the background thread, without the GIL):
        xgrammar's rows (`XgrammarMatchers.fill`), then llguidance's (`_fill_guidance`)."""
        if schemas:
            assert self._xgrammar is not None  # made with the schemas' matchers
            self._xgrammar.fill([m for m, _ in schemas], mask, [row for _, row in schemas])
        if constrained or parts:
            self._fill_guidance(constrained, parts, mask)

    def _fill_guidance(self, constrained: list[tuple[llguidance.LLMatcher, int]],
                       parts: list[tuple[list[llguidance.LLMatcher], int]], mask: torch.Tensor
                       ) -> None:
        """Writes llguidance's rows of `mask`: the rows of `constrained` by their matchers,
        the rows of `parts` by their parts' matchers, each part's range of words taken from
        its own full row of scratch."""
        executor = self._fill_executor()
        # llguidance.torch's fill_next_token_bitmask_par, whose module torch.compiles a
        # function at import (seconds of every engine start for a helper we do not use)
        assert mask.dtype == torch.int32 and mask.is_contiguous() and mask.device.type == "cpu"
        if not parts:
            executor.unsafe_compute_mask_ptr(constrained, mask.data_ptr(), mask.shape[1] * 4,
                                             mask.shape[0])
            return
        split = self._split
        assert split is not None
        base = len(constrained)
        slots = base + split.parts * len(parts)
        if self._scratch.shape[0] < slots:
            self._scratch = torch.empty(slots, mask.shape[1], dtype=torch.int32)
        scratch = self._scratch[:slots]
        # the split rows (the costly ones) first in line for the threads
        jobs = [(matcher, base + i * split.parts + k)
                for i, (matchers, _) in enumerate(parts) for k, matcher in enumerate(matchers)]
        jobs += [(matcher, slot) for slot, (matcher, _) in enumerate(constrained)]
        executor.unsafe_compute_mask_ptr(jobs, scratch.data_ptr(), mask.shape[1] * 4, slots)
        if constrained:
            mask[[row for _, row in constrained]] = scratch[:base]
        rows = [row for _, row in parts]
        by_part = scratch[base:].view(len(parts), split.parts, -1)
        for k, (lo, hi) in enumerate(split.words):
            mask[rows, lo:hi] = by_part[:, k, lo:hi]

    def draft_bitmask(self, seq: Sequence, drafts: list[int]) -> torch.Tensor | None:
        """Gives the int32 [len(drafts) + 1, words] masks of a speculating sequence's verify
        rows, None when it is unconstrained: row j is the grammar's state after the first j
        drafts. Past the first draft the grammar refuses, rows repeat the mask of that state
        (the target rejects that draft there, so later rows are never read). The matcher
        ends where it started (rolled back)."""
        if seq.request.grammar is None:
            return None
        out = torch.empty(len(drafts) + 1, self._buffer.words, dtype=torch.int32)
        matcher = self._resolved(seq.request)
        if matcher is None:
            out[:] = self._eos_only
            return out
        if isinstance(matcher, xgrammar.GrammarMatcher):
            return self._xgrammar_draft_bitmask(matcher, drafts, out)
        valid = matcher.validate_tokens(drafts)
        for j in range(valid + 1):
            words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            out[j] = words[:out.shape[1]]  # the tokenizer's words may run past the model's
            if j < valid:
                matcher.consume_token(drafts[j])
        out[valid + 1:] = out[valid]
        matcher.rollback(valid)
        return out

    def _xgrammar_draft_bitmask(self, matcher: xgrammar.GrammarMatcher, drafts: list[int],
                                out: torch.Tensor) -> torch.Tensor:
        """`draft_bitmask` for an xgrammar matcher: takes the drafts while it can, filling a
        row before each, then rolls back; past EOS (the grammar ended) rows allow only EOS."""
        taken = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                out[j:] = self._eos_only
                break
            matcher.fill_next_token_bitmask(out, j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                out[j + 1:] = out[j]
                break
            taken += 1
        matcher.rollback(taken)
        return out

    def accept(self, seq: Sequence, token: int) -> None:
        """Advances `seq`'s matcher (and its parts) by its sampled `token`."""
        self.accept_tokens([(seq, token)])

    def accept_tokens(self, taken: list[tuple[Sequence, int]]) -> None:
        """Advances the matchers of the constrained sequences of `taken` (and their parts, each
        token spelled in the part's own) by their sampled tokens, all at once on llguidance's
        threads, one token per matcher a round. A full matcher that refuses its token fails
        its request (the mask allowed only grammar tokens: a matcher fault, not the model's);
        a part that refuses one drops the request's split."""
        queues: list[tuple[Request, llguidance.LLMatcher, list[int], bool]] = []
        schemas: list[tuple[Request, xgrammar.GrammarMatcher, int]] = []
        for seq, token in taken:
            request = seq.request
            if request.grammar is None:
                continue
            matcher = self._resolved(request)
            if matcher is None:
                continue
            if isinstance(matcher, xgrammar.GrammarMatcher):
                schemas.append((request, matcher, token))
                continue
            queues.append((request, matcher, [token], False))
            if isinstance(request.grammar_parts, Future) and not request.grammar_parts.done():
                request.grammar_pending.append(token)  # `_ready_parts` feeds them once there
                continue
            split = self._split
            for k, part in enumerate(self._ready_parts(request)):
                assert split is not None
                queues.append((request, part, split.spelling(k, token), True))
        if schemas:
            assert self._xgrammar is not None  # made with the schemas' matchers
            took = self._xgrammar.accept([m for _, m, _ in schemas], [t for _, _, t in schemas])
            for (request, matcher, token), ok in zip(schemas, took, strict=True):
                if not ok:
                    why = (NOTHING_ALLOWED if self._xgrammar.allows_nothing(matcher)
                           else f"refused token {token}")
                    log.warning("request %s: grammar matcher %s", request.request_id, why)
                    request.grammar = _fail(request, why)
        if not queues:
            return
        if len(queues) == 1:  # one matcher (a synchronous step's row): no executor round
            request, matcher, tokens, is_part = queues[0]
            self._took(request, matcher, is_part, all(matcher.consume_token(t) for t in tokens))
            return
        executor = self._fill_executor()
        for j in range(max(len(tokens) for _, _, tokens, _ in queues)):
            # a failed request takes no more; nor do parts dropped by a refusal
            batch = [q for q in queues if len(q[2]) > j and not isinstance(q[0].grammar, str)
                     and (not q[3] or q[0].grammar_parts)]
            if not batch:
                break
            took = executor.consume_token_par([(m, tokens[j]) for _, m, tokens, _ in batch])
            for (request, matcher, _, is_part), ok in zip(batch, took, strict=True):
                self._took(request, matcher, is_part, ok)

    def _took(self, request: Request, matcher: llguidance.LLMatcher, is_part: bool, ok: bool
              ) -> None:
        """Acts on whether `matcher` (`request`'s, or one of its parts) took its token."""
        if ok:
            return
        if is_part:
            self._drop_parts(request)
            return
        log.warning("request %s: grammar matcher refused a token: %s", request.request_id,
                    matcher.get_error())
        request.grammar = _fail(request, f"refused a token: {matcher.get_error()}")

    def shutdown(self) -> None:
        """Stops the compiling and filling threads: what is queued is dropped, what runs
        finishes, and the threads are joined."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fill_pool.shutdown(wait=True, cancel_futures=True)


class MaskFill:
    """One step's mask, being filled on the background thread."""

    def __init__(self, buffer: BitmaskBuffer, mask: torch.Tensor, filling: Future[None] | None
                 ) -> None:
        self._buffer = buffer
        self._mask = mask
        self._filling = filling

    def wait(self) -> torch.Tensor:
        """Gives the filled mask on the device (copied without waiting), once the fill is done
        (re-raising what failed it)."""
        if self._filling is not None:
            self._filling.result()
        return self._buffer.to_device(self._mask)


def _fail(request: Request, why: str) -> str:
    """Gives the failed-grammar state of `request` (its error message), setting its error."""
    request.error = f"structured_outputs grammar {why}"
    return request.error

