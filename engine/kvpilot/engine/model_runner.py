"""Runs the model on one scheduled step: owns the paged KV cache, builds the flat batch.

The batch is the layout of `engine/attention/metadata.py`: the step's new tokens
laid end to end, decodes first, with block tables and a slot mapping built in
numpy (no per-token Python loops). Only the rows that sample (or that need
prompt logprobs) go through the LM head.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.contracts.args import EngineArgs, parse_size
from kvpilot.engine.cuda_graphs import DecodeGraphs, capture_decode_graphs
from kvpilot.engine.device import StagingBuffer, to_device

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig

CPU_KV_CACHE_DEFAULT = "256MiB"


@dataclass
class BatchEntry:
    """One sequence's part of a step: its new tokens from `start_pos`, its blocks, which logits."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int] | np.ndarray
    logits: str = "last"  # "none" | "last" | "all" (prompt logprobs)
    # >= 0: the last token is still being sampled by the step in flight (async scheduling);
    # its id is row `patch_row` of that step's sampled tokens, read on the device
    patch_row: int = -1


def select_attention_backend(args: EngineArgs, device: torch.device) -> AttentionBackend:
    """Gives the attention backend for `--attention-backend` on `device` (the kernels' seam)."""
    name = args.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        try:
            from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            if args.attention_backend == "triton":
                raise ValueError(f"attention_backend='triton' is unavailable ({exc}): "
                                 "use --attention-backend torch") from exc
        else:
            if device.type != "cuda":
                raise ValueError("attention_backend='triton' needs a CUDA device: "
                                 "use --attention-backend torch on CPU")
            return TritonAttentionBackend()
    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    return TorchAttentionBackend()


class ModelRunner:
    """Holds the model and its KV cache; executes steps and block copies."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device
                 ) -> None:
        from kvpilot.engine.models.loader import load_model

        self.args = args
        self.config = model_config
        self.device = device
        self.block_size = args.block_size
        started = time.perf_counter()
        self.model = load_model(model_config, args.load_format, device, seed=args.seed)
        self.load_seconds = time.perf_counter() - started
        self.model.attn_backend = select_attention_backend(args, device)
        self.decode_graphs: DecodeGraphs | None = None  # set once the KV cache exists
        self._staging = StagingBuffer(device)  # build_batch's host buffer
        self._patches: torch.Tensor | None = None  # build_batch's [2, k] (position, row) pairs
        # forwards run by a CUDA graph and eagerly (prefill and mixed steps, CPU, start-up)
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, model_config.num_kv_heads,
                 model_config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model_config.dtype, device=device)
                          for _ in range(model_config.num_layers)]
        started = time.perf_counter()
        self.decode_graphs = capture_decode_graphs(self.model, self.kv_caches, args,
                                                   model_config.max_model_len)
        self.graph_seconds = time.perf_counter() - started

    @property
    def bytes_per_block(self) -> int:
        cfg = self.config
        elem = torch.tensor([], dtype=cfg.dtype).element_size()
        return 2 * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem * cfg.num_layers

    def _num_kv_blocks(self) -> int:
        """Gives the KV block count: exact flag, memory budget, or what the GPU has left."""
        args = self.args
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        if args.kv_cache_memory is not None or self.device.type != "cuda":
            budget = parse_size(args.kv_cache_memory or CPU_KV_CACHE_DEFAULT)
            return max(budget // self.bytes_per_block, 1)
        return self._profile_gpu_blocks()

    def _profile_gpu_blocks(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.args.max_num_batched_tokens, self.config.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        cfg = self.config
        scratch = [torch.zeros((2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim),
                               dtype=cfg.dtype, device=self.device) for _ in range(cfg.num_layers)]
        entry = BatchEntry([0] * num_tokens, 0, list(range(num_blocks)))
        self._run([entry], scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_bytes = int(total * self.args.gpu_memory_utilization) - peak
        if free_bytes < self.bytes_per_block:
            raise ValueError(f"gpu_memory_utilization={self.args.gpu_memory_utilization} leaves no "
                             "room for the KV cache after the model: raise it or lower "
                             "max_num_batched_tokens")
        return free_bytes // self.bytes_per_block

    def build_batch(self, entries: list[BatchEntry]
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Gives input ids, positions, attention metadata and the logits rows of `entries`."""
        bs = self.block_size
        n = len(entries)
        query_lens = np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n)
        starts = np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n)
        seq_lens = starts + query_lens
        total = int(query_lens.sum())
        # everything travels in one int64 host buffer and one host-to-device copy
        num_blocks = np.fromiter((len(e.block_ids) for e in entries), dtype=np.int64, count=n)
        max_blocks = int(num_blocks.max())
        # sections start at even offsets: 16-byte aligned device views for the kernels
        t2, n2 = total + total % 2, n + 1 + (n + 1) % 2
        at_lens, at_tables = 3 * t2 + n2, 3 * t2 + 2 * n2
        at_patch = at_tables + n * max_blocks
        patched = [i for i, e in enumerate(entries) if e.patch_row >= 0]
        size = at_patch + 2 * len(patched)
        host, host_tensor = self._staging.host(size)
        ids, positions, slots = host[:total], host[t2:t2 + total], host[2 * t2:2 * t2 + total]
        qsl = host[3 * t2:3 * t2 + n + 1]
        lens = host[at_lens:at_lens + n]
        tables = host[at_tables:at_patch].reshape(n, max_blocks)
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:])
        lens[:] = seq_lens
        tables.fill(-1)
        tables[np.arange(max_blocks) < num_blocks[:, None]] = np.concatenate(
            [e.block_ids for e in entries])
        if total == n:  # a decode step: one token per sequence, at position start
            seq_of_token = np.arange(n)
            positions[:] = starts
            ids[:] = np.fromiter((e.token_ids[0] for e in entries), dtype=np.int64, count=n)
        else:
            seq_of_token = np.repeat(np.arange(n), query_lens)
            positions[:] = np.arange(total) - qsl[:-1][seq_of_token] + starts[seq_of_token]
            ids[:] = np.fromiter(itertools.chain.from_iterable(e.token_ids for e in entries),
                                 dtype=np.int64, count=total)
        slots[:] = tables[seq_of_token, positions // bs] * bs + positions % bs
        logits_rows: list[int] = []
        for i, e in enumerate(entries):
            if e.logits == "last":
                logits_rows.append(int(qsl[i + 1]) - 1)
            elif e.logits == "all":
                logits_rows.extend(range(int(qsl[i]), int(qsl[i + 1])))
        num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else n
        if patched:  # (flat position, sampled row) pairs of the tokens still being sampled
            pairs = host[at_patch:size].reshape(2, len(patched))
            pairs[0] = qsl[1:][patched] - 1
            pairs[1] = [entries[i].patch_row for i in patched]
        dev_buf = self._staging.upload(host_tensor)
        self._patches = dev_buf[at_patch:size].view(2, len(patched)) if patched else None
        i32 = torch.int32
        meta = AttentionMetadata(
            slot_mapping=dev_buf[2 * t2:2 * t2 + total],
            query_start_loc=dev_buf[3 * t2:3 * t2 + n + 1].to(i32),
            seq_lens=dev_buf[at_lens:at_lens + n].to(i32),
            block_tables=dev_buf[at_tables:at_patch].view(n, max_blocks).to(i32),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_decode_tokens=num_decodes,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return dev_buf[:total], dev_buf[t2:t2 + total], meta, logits_rows

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole blocks src -> dst on every layer (copy-on-write before a step writes)."""
        if not copies:
            return
        src = self._index([s for s, _ in copies])
        dst = self._index([d for _, d in copies])
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Gives the hidden states of one flat batch (decode steps replay a CUDA graph)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(meta, kv_caches):
            self.num_graph_steps += 1
            return graphs.replay(input_ids, positions, meta)
        self.num_eager_steps += 1
        return self.model(input_ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def _run(self, entries: list[BatchEntry], kv_caches: list[torch.Tensor],
             prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        input_ids, positions, meta, rows = self.build_batch(entries)
        if self._patches is not None:
            if prev_tokens is None:
                raise ValueError("entries have patch_row set but no prev_tokens were given")
            positions_to_patch, sampled_rows = self._patches
            input_ids[positions_to_patch] = prev_tokens[sampled_rows]
        hidden = self.forward(input_ids, positions, meta, kv_caches)
        if not rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        if len(rows) == hidden.shape[0]:
            # every row samples (a decode step): rows are 0..T-1, so skip the gather and its
            # host-to-device copy (with a pageable source, that copy waited for the forward)
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, self._index(rows)))

    def _index(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device, torch.long)

    def execute(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step; gives float32 logits for the rows `entries` ask for, in entry order.

        `prev_tokens` are the sampled ids of the step still in flight; entries with
        `patch_row` take their last input token from it on the device.
        """
        with torch.inference_mode():
            self.copy_blocks(copies)
        return self._run(entries, self.kv_caches, prev_tokens)
