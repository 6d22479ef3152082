"""The Triton attention backend: paged KV write, then decode and prefill kernels.

The flat batch puts decode rows (query_len 1) first (`num_decode_tokens` of
them): those go through the split-K decode kernel, which reads each KV block
once per KV head for the whole GQA group; the rest of the batch goes through
the prefill kernel, which attends to each sequence's cached prefix and its new
tokens. Every launch shape is a function of host-side sizes only (no device
syncs), so one decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import itertools

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.kv_cache_write import kv_cache_write
from kvpilot.kernels.paged_decode_attention import default_num_splits, paged_decode_attention
from kvpilot.kernels.paged_prefill_attention import (
    GATHER_MIN_QUERY,
    no_prefix_kernel_ok,
    paged_prefill_attention,
)


class TritonAttentionBackend:
    """Implements `AttentionBackend` with the kernels of `kvpilot.kernels` (CUDA only)."""

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.num_sms = num_sms or 132

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0),
                kv_written: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gives the attention output [T, num_heads, head_dim] (in `out` when given) after
        caching this step's k, v (unless the caller has: `kv_written`)."""
        if not kv_written:
            kv_cache_write(k, v, kv_cache, meta.slot_mapping, kv_scales)
        if out is None:
            out = torch.empty_like(q)
        num_tokens = q.shape[0]
        # a batch of only single-token queries is all decode even if the runner did not say so
        num_decodes = num_tokens if meta.max_query_len == 1 else meta.num_decode_tokens
        if num_decodes:
            splits = default_num_splits(num_decodes, kv_cache.shape[3], meta.max_seq_len,
                                        self.num_sms)
            order = meta.decode_order
            paged_decode_attention(q[:num_decodes], kv_cache, meta.block_tables[:num_decodes],
                                   meta.seq_lens[:num_decodes], scale, num_splits=splits,
                                   out=out[:num_decodes], kv_scales=kv_scales,
                                   order=order if order is not None
                                   and order.shape[0] == num_decodes else None)
        if num_decodes < num_tokens:
            self._prefill(q, k, v, kv_cache, meta, scale, kv_scales, num_decodes, out)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, kv_scales: tuple[float, float],
                 num_decodes: int, out: torch.Tensor) -> None:
        """Runs prefill attention over the sequences after the decode rows, in up to two
        launches: those up to the last one with a cached prefix (a chunk continuing a prompt,
        a prefix-cache hit), then the rest as a batch with no prefix, which the launcher gives
        its faster no-prefix kernel where that runs (else one launch takes them all)."""
        end, prefixed = meta.num_seqs, meta.prefixed_prefills
        fast = no_prefix_kernel_ok(q, k, v)
        if prefixed is None:  # unknown: every sequence may have a prefix
            split = end
        elif prefixed == 0:
            split = num_decodes
        else:  # two launches only where the second takes the faster kernel
            split = num_decodes + prefixed if fast else end
        for first, last, prefix in ((num_decodes, split, None), (split, end, 0)):
            if first < last:
                # query_start_loc holds absolute row offsets, so the kernels take their
                # sequences' slices and index the full q/k/v/out
                starts, lens = (TritonAttentionBackend._host_lengths(meta, first, last)
                                if prefix is None and fast else (None, None))
                paged_prefill_attention(q, k, v, kv_cache, meta.block_tables[first:last],
                                        meta.query_start_loc[first:last + 1],
                                        meta.seq_lens[first:last], meta.max_query_len, scale,
                                        out=out, kv_scales=kv_scales, max_prefix_len=prefix,
                                        query_start_loc_cpu=starts, seq_lens_cpu=lens)

    @staticmethod
    def _host_lengths(meta: AttentionMetadata, first: int, last: int
                      ) -> tuple[list[int] | None, list[int] | None]:
        """Gives host copies of query_start_loc[first:last + 1] and seq_lens[first:last],
        which let the launcher run sequences with a cached prefix on the Gluon kernel; (None,
        None) where the metadata has none or no sequence is long enough for that to pay."""
        qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
        if qlens is None or slens is None or meta.max_query_len < GATHER_MIN_QUERY:
            return None, None
        starts = list(itertools.accumulate(qlens[:last], initial=0))
        return starts[first:], slens[first:last]
