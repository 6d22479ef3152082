"""Sampling of the next token for every sequence of a step, vectorised over the batch.

Semantics follow vLLM: penalties (repetition on prompt+output, presence and
frequency on output), then temperature, min_p, top_k and top_p; greedy rows take
the argmax of the penalised logits. Log-probabilities are the model's raw
distribution (log_softmax of the logits before any processing), with the rank of
the sampled token. Random rows draw with the exponential-race trick so a seeded
row's draw depends only on its own torch.Generator.

`Sampler(fused=True)` (the engine's choice on CUDA) draws a batch whose random rows ask
for temperature only (no min_p, top_k, top_p, no seed; greedy rows may sit beside them)
with one Triton pass instead (`kvpilot.kernels.sampling`): the Gumbel-max trick, the same
distribution as the exponential race, reads each logit once, bf16 as the model gave it
(float32 after penalties), where the torch path makes several float32 passes over the
vocabulary. Its noise comes from Philox keyed by a seed drawn on the device from torch's
generator, so `torch.manual_seed` still makes runs repeat, though not the torch path's
tokens. Bitmask, banned tokens, penalties and forced tokens apply as on the torch path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.structured.bitmask import apply_token_bitmask
from kvpilot.engine.worker.device import to_device

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    token_ids: list[int]  # prompt then output; sliced only when penalties need it
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    banned_token_ids: list[int] | None = None  # eos/stop ids while below min_tokens
    num_logprobs: int = 0  # top alternatives to return (beam search asks for beam_width)
    forced_token_id: int | None = None  # emitted instead of a sample (`first_token_id`)


@dataclass
class SamplerOutput:
    """Sampled token per row; where any row asks, every row's raw logprob and rank, and its
    top alternatives where any row asks for some (the lists stay empty otherwise)."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Gives `rows` as one [len(rows), max(longest, 1)] long tensor, right-padded with `pad`."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(int(lens.max(initial=0)), 1)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    # row-major fill of the unpadded cells (ModelRunner.build_batch's block-table idiom):
    # no Python int per pad cell, which cost ~0.5 s for one 8k prompt among 255 short ones
    out[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(rows),
                                                        dtype=np.int64, count=int(lens.sum()))
    return to_device(out, device, torch.long)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    n, vocab = logits.shape
    dev = logits.device
    presence = to_device([r.params.presence_penalty for r in rows], dev)
    frequency = to_device([r.params.frequency_penalty for r in rows], dev)
    repetition = to_device([r.params.repetition_penalty for r in rows], dev)
    # one spare column absorbs the padding index
    out_ids = _padded([r.token_ids[r.num_prompt_tokens:] for r in rows], vocab, dev)
    counts = torch.zeros(n, vocab + 1, device=dev).scatter_add_(
        1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :vocab]
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        prompt_ids = _padded([r.token_ids[:r.num_prompt_tokens] for r in rows], vocab, dev)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Gives `logits` (float) with each row's `logit_bias` added to its tokens' logits."""
    out = logits.clone()
    dev = logits.device
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), dev, torch.long)
            out[i].index_add_(0, ids, to_device(list(p.logit_bias.values()), dev,
                                                torch.float32))
    return out


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token once the mass strictly before it already reaches top_p (keeps >= 1 token)
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _per_row(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Gives `values` as a float32 tensor on `device`; one value for every row (the common
    case) is a device-side fill, no blocking host copy, with the same float32 values."""
    if all(v == values[0] for v in values):
        return torch.full((len(values),), values[0], dtype=torch.float32, device=device)
    return to_device(values, device, torch.float32)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Gives each row's sampling distribution: softmax after temperature, min_p, top_k, top_p
    (float32 [N, vocab]; what a random row draws from and what speculation must keep)."""
    dev = logits.device
    temperature = _per_row(tuple(max(p.temperature, 1e-5) for p in params), dev)
    logits = logits.float() / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = to_device([p.min_p for p in params], dev)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = to_device([p.top_k for p in params], dev)
        top_p = to_device([p.top_p for p in params], dev)
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _argmax_chunk(vocab: int) -> int | None:
    """Gives a divisor of `vocab` in [512, 4096] for `argmax_rows`' two passes, or None."""
    return next((c for c in range(2048, 511, -1) if vocab % c == 0), None) or \
        next((c for c in range(2049, 4097) if vocab % c == 0), None)


def argmax_rows(logits: torch.Tensor, two_pass: bool | None = None) -> torch.Tensor:
    """Gives each row's argmax (the first index of its largest value, as torch's argmax).

    torch reduces a long row in one block: 27 us for one 128k-vocabulary row on an H100, the
    largest kernel of a batch-1 step after the GEMMs. Two passes over chunks that divide the
    vocabulary (each chunk's max, then the first chunk holding the row's max) spread it: on
    CUDA for vocabularies from 16k, or as `two_pass` says."""
    rows, vocab = logits.shape
    if two_pass is None:
        two_pass = logits.is_cuda and vocab >= 16384
    chunk = _argmax_chunk(vocab) if two_pass else None
    if chunk is None:
        return logits.argmax(dim=-1)
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)  # the first chunk whose max is the row's
    return (best * chunk + within.gather(1, best))[:, 0]


def _fusable(row: SamplingRow, greedy: bool) -> bool:
    """Whether the fused Gumbel-max kernel may draw `row` (from the torch path's distribution):
    a greedy row, or a random one at temperature only (no seeded generator, min_p, top_k or
    top_p)."""
    p = row.params
    return greedy or (row.generator is None and p.min_p == 0 and p.top_k <= 0
                      and p.top_p >= 1.0 and not p.logit_bias)


class Sampler:
    """Turns a step's logits [N, vocab] into one next token per row; `fused` draws
    temperature-only batches with the Triton Gumbel-max kernel (module docstring)."""

    def __init__(self, fused: bool = False,
                 on_path: Callable[[list[str]], None] | None = None) -> None:
        self.fused = fused
        # told each batch's kind ("sampler-batch:fused": every row greedy or temperature-only,
        # the Triton kernel's batch on CUDA; "sampler-batch:torch": a random row needs torch's
        # ops): the engine's path log, since a batch's kind is not any one request's
        self.on_path = on_path
        if fused:
            try:
                import kvpilot.kernels.sampling  # noqa: F401  (Triton, on the first fused batch)
            except ImportError as exc:  # e.g. a CUDA build without Triton: the torch path
                logger.warning("fused sampling unavailable (%s); the sampler runs torch ops", exc)
                self.fused = False

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Gives the sampled tokens (and logprobs where any row asks) for `rows`; `bitmask`
        (int32 [N, ceil(vocab / 32)], structured outputs) leaves only its set bits."""
        token_ids = self.sample_ids(logits, rows, bitmask)
        # one device-to-host copy per step: the only point where the host waits for the GPU
        out = SamplerOutput(token_ids=token_ids.tolist())
        if any(r.params.logprobs is not None or r.num_logprobs for r in rows):
            self._add_logprobs(out, logits.float(), token_ids, max(r.num_logprobs for r in rows))
        return out

    def sample_ids(self, logits: torch.Tensor, rows: list[SamplingRow],
                   bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Gives the sampled token per row as a long tensor on the logits' device.

        Nothing here waits for the GPU: per-row parameters travel with
        non-blocking copies, so async scheduling can launch a step's sampling
        and read the tokens back one step later.
        """
        params = [r.params for r in rows]
        greedy = [p.greedy or p.beam_width > 1 for p in params]
        fusable = not all(greedy) and all(map(_fusable, rows, greedy))
        fused = self.fused and fusable
        if self.on_path is not None and not all(greedy):
            self.on_path(["sampler-batch:fused" if fusable else "sampler-batch:torch"])
        # the model's logits (bf16 on a GPU) are widened only where arithmetic follows: the
        # kernel widens each logit as it loads it, and an argmax picks the same row either way
        if not fused and not all(greedy):
            logits = logits.float()
        if bitmask is not None:  # the grammar's allowed tokens, before any other processing
            logits = apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
        if any(p.logit_bias for p in params):
            logits = _apply_logit_bias(logits.float(), params)
        if any(r.banned_token_ids for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.banned_token_ids:
                    logits[i, r.banned_token_ids] = float("-inf")
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
               for p in params):
            logits = _apply_penalties(logits.float(), rows)
        if all(greedy):
            ids = argmax_rows(logits)
        elif fused:
            ids = self._sample_fused(logits, params, greedy)
        else:
            ids = self._sample_random(logits, rows, greedy)
        if any(r.forced_token_id is not None for r in rows):
            forced = [-1 if r.forced_token_id is None else r.forced_token_id for r in rows]
            forced_ids = to_device(forced, ids.device, torch.long)
            ids = torch.where(forced_ids >= 0, forced_ids, ids)
        return ids

    def _sample_fused(self, logits: torch.Tensor, params: list[SamplingParams],
                      greedy: list[bool]) -> torch.Tensor:
        from kvpilot.kernels import sampling

        dev = logits.device
        temperature = _per_row(tuple(0.0 if g else p.temperature
                                     for p, g in zip(params, greedy, strict=True)), dev)
        # from torch's generator of the device, queued: the host never waits for it
        seed = torch.randint(2**62, (1,), dtype=torch.long, device=dev)
        return sampling.gumbel_max_sample(logits, temperature, seed)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow],
                       greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        greedy_logits = logits
        probs = processed_probs(logits, [r.params for r in rows])
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if len(unseeded) == len(rows):
            # no seeded row: the one draw is the noise (same values as scattering it row by row)
            noise = torch.empty(len(rows), probs.shape[1], device=dev).exponential_()
        else:
            noise = torch.empty_like(probs)
            if unseeded:
                # a list index would reach the device by a copy that waits for the forward
                noise[to_device(unseeded, dev, torch.long)] = torch.empty(
                    len(unseeded), probs.shape[1], device=dev).exponential_()
            for i, r in enumerate(rows):
                if r.generator is not None:
                    noise[i].exponential_(generator=r.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if not any(greedy):
            return sampled
        greedy_ids = argmax_rows(greedy_logits)
        return torch.where(to_device(greedy, dev), greedy_ids, sampled)

    def _add_logprobs(self, out: SamplerOutput, raw: torch.Tensor, token_ids: torch.Tensor,
                      num_logprobs: int) -> None:
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None])
        out.logprobs = chosen[:, 0].tolist()
        out.ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        if num_logprobs > 0:
            top = logprobs.topk(num_logprobs, dim=-1)
            out.top_ids = top.indices.tolist()
            out.top_logprobs = top.values.tolist()


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num_top: int
                    ) -> list[tuple[float, int, list[int], list[float]]]:
    """Gives, per prompt position, the next prompt token's (logprob, rank, top ids, top logprobs)."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    if num_top > 0:
        top = logprobs.topk(num_top, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_lps = [[] for _ in ranks], [[] for _ in ranks]
    return list(zip(chosen[:, 0].tolist(), ranks, top_ids, top_lps, strict=True))
