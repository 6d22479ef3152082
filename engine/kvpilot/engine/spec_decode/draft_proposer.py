"""A draft model (vLLM's `draft_model` method): a smaller model sharing the tokenizer proposes.

The draft has its own paged KV cache with as many blocks as the target's and
reads the target's block tables, so the scheduler's draft slots hold the draft's
K/V too. Per sequence it remembers how far its cache is valid; a proposal first
computes the verified tokens past that point (the whole prompt the first time:
prefix-cache hits are the target's K/V only), then decodes k - 1 more tokens one
at a time. The draft weights load before the target sizes its KV cache, and the
block count covers both caches (`share_kv_blocks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.speculative import SpeculativeConfig
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Sequence
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.spec_decode.proposers import Drafts, exponential_rows
from kvpilot.engine.worker.device import to_device
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.worker.row_layout import RowLayout
from kvpilot.engine.worker.sampler import processed_probs
from kvpilot.engine.worker.step_batch import BatchEntry


def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    """Gives the bytes one KV block of a one-rank cache of `config` takes."""
    elem = torch.tensor([], dtype=config.dtype).element_size()
    return 2 * block_size * config.num_kv_heads * config.head_dim * elem * config.num_layers


@dataclass
class DraftModel:
    """A loaded draft model, before it has a KV cache."""

    args: EngineArgs
    config: ModelConfig
    model: LlamaForCausalLM

    def share_kv_blocks(self, target: ModelConfig) -> Callable[[int], int]:
        """Gives the map from the target's own KV block count to the count both caches get
        from the same budget (an exact --num-kv-blocks stays as given)."""
        if self.args.num_kv_blocks is not None:
            return lambda num_blocks: num_blocks
        own = kv_bytes_per_block(target, self.args.block_size)
        both = own + kv_bytes_per_block(self.config, self.args.block_size)
        return lambda num_blocks: max(num_blocks * own // both, 1)


def load_draft(args: EngineArgs, spec: SpeculativeConfig, target: ModelConfig,
               device: torch.device) -> DraftModel:
    """Gives the draft model `spec` names, loaded on `device`; raises ValueError when its
    vocabulary differs from the target's (the draft must share the tokenizer)."""
    from kvpilot.engine.models.hub_cache import with_local_model
    from kvpilot.engine.models.loader import load_model

    if spec.model is None:
        raise ValueError("a draft-model speculative_config needs 'model'")
    # a dummy target (benchmarks) gets a dummy draft: same seed, so a draft naming the
    # target's config has the target's weights
    load_format = "dummy" if args.load_format == "dummy" else "auto"
    draft_args = with_local_model(replace(
        args, model=spec.model, served_model_name=None, tokenizer=None, load_format=load_format,
        max_model_len=target.max_model_len, speculative_config=None))
    config = ModelConfig.from_engine_args(draft_args, device)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model={spec.model!r} has vocab_size="
                         f"{config.vocab_size} but the target {args.model!r} has "
                         f"{target.vocab_size}: the draft must share the target's tokenizer")
    model = load_model(config, draft_args.load_format, device, seed=args.seed)
    return DraftModel(draft_args, config, model)


class DraftModelProposer:
    """Runs the draft model over the target's block tables to propose k tokens per decode."""

    def __init__(self, draft: DraftModel, num_blocks: int, kv: KVCacheManager,
                 device: torch.device) -> None:
        self.runner = ModelRunner(replace(draft.args, num_kv_blocks=num_blocks), draft.config,
                                  device, model=draft.model)
        self.kv = kv
        self.rows = RowLayout.of(self.runner.load_report())
        # seq -> positions whose draft K/V hold that sequence's verified tokens
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Drafts]:
        """Gives k_i draft tokens (and the draft's distribution at each) per (seq, k_i).

        A sequence whose drafts were all accepted comes back two tokens past the
        draft's K/V (the last draft and the bonus token). `_run` runs such a short
        entry as single-token rows where the draft's decode graph then replays the
        step (`engine.row_layout`, as the target's steps): a two-token entry made the
        whole first draft step eager, and the more drafts were accepted, the more often
        (H100, 8B-shaped target, 2-layer draft, batch 1: 0.81-0.91x the target alone at
        acceptance 0.86-0.93 before, 1.22-1.26x at 0.85-0.88 after; single runs, and
        this bench's batch-1 rows vary by up to 1.5x between runs).
        """
        block_ids = [self.kv.block_id_array(seq) for seq, _ in items]
        entries: list[BatchEntry] = []
        for (seq, _), blocks in zip(items, block_ids, strict=True):
            start = min(self._computed.get(seq, 0), seq.num_computed_tokens)
            entries.append(BatchEntry(seq.token_ids[start:], start, blocks))
        tokens: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = list(range(len(items)))
        logits = self._run(entries)
        while True:
            self._draw(logits, [items[i][0] for i in active], active, tokens, probs)
            active = [i for i in active if len(tokens[i]) < items[i][1]]
            if not active:
                break
            # the last draft at its position: the context, then the drafts before it
            entries = [BatchEntry([tokens[i][-1]], len(items[i][0].token_ids) + len(tokens[i]) - 1,
                                  block_ids[i]) for i in active]
            logits = self._run(entries)
        for seq, k in items:
            # K/V written for the context and drafts 1..k-1; the engine's verification
            # keeps the accepted ones, so validity is capped by num_computed_tokens
            self._computed[seq] = len(seq.token_ids) + k - 1
        return [Drafts(t, torch.stack(p)) for t, p in zip(tokens, probs, strict=True)]

    def forget(self, seq: Sequence) -> None:
        """Drops a preempted sequence's validity: its blocks (and draft K/V) are gone."""
        self._computed.pop(seq, None)

    def _run(self, entries: list[BatchEntry]) -> torch.Tensor:
        """Gives the draft's last-token logits per entry, running single-token entries first
        (and short ones as single-token rows where that replays a graph: `self.rows`)."""
        order = sorted(range(len(entries)), key=lambda i: len(entries[i].token_ids) != 1)
        logits = self.runner.execute(self.rows.expand([entries[i] for i in order]), [])
        if order == sorted(order):
            return logits
        back = [0] * len(order)
        for row, i in enumerate(order):
            back[i] = row
        return logits.index_select(0, to_device(back, logits.device))

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
              tokens: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        """Samples one draft per row from the draft's processed distribution (greedy: argmax,
        recorded as a point mass) and records token and distribution; the host waits for
        the device once, for the tokens."""
        params = [seq.request.params for seq in seqs]
        greedy = [p.greedy for p in params]
        if all(greedy):  # what the race below gives for point masses, without the noise
            drawn = logits.argmax(dim=1)
            q = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, drawn[:, None], 1.0)
        else:
            q = processed_probs(logits, params)
            if any(greedy):
                one_hot = torch.zeros_like(q).scatter_(1, logits.argmax(dim=1, keepdim=True),
                                                       1.0)
                q = torch.where(to_device(greedy, logits.device)[:, None], one_hot, q)
            noise = exponential_rows([seq.generator for seq in seqs], q.shape[1], q.device)
            drawn = (q / noise).argmax(dim=1)
        for j, (i, token) in enumerate(zip(rows, drawn.tolist(), strict=True)):
            tokens[i].append(token)
            probs[i].append(q[j])
