"""CUDA graphs for decode steps: capture once per padded batch size, replay every step.

A decode step of a small model is dozens of short kernel launches per layer;
on a fast GPU the CPU cannot issue them as fast as the GPU runs them. A CUDA
graph records the whole forward once and replays it with one launch. Graphs
need static shapes and addresses, so inputs live in persistent buffers and a
batch of ``n`` sequences runs the graph of the smallest bucket ``>= n``; the
padding rows get ``seq_len = 0`` (attention writes zeros for them) and slot
``-1`` (no KV write), so they cannot touch a real sequence's cache.

Only pure decode batches (every query length 1) replay; prefill and mixed
steps run eagerly. The Triton backend's decode launch depends on the batch
size alone (split lengths come from ``seq_len`` on the device), which is what
makes one graph valid for every context length up to ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.graph_inputs import DecodeInputs, copy_decode_inputs

if TYPE_CHECKING:
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.models.llama import LlamaForCausalLM

# the model's forward: (input_ids, positions, kv_caches, meta) -> hidden states
Forward: TypeAlias = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata],
                              torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Gives the captured batch sizes: 1, 2, 4, then every multiple of 8 up to max_num_seqs."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Holds one captured decode forward per bucket and the static buffers they read."""

    def __init__(self, forward: Forward, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # the decode kernel's launch order: a step's rows get its order, the padding rows
        # their own index, so the whole is a permutation of the bucket's rows
        self.decode_order = torch.arange(n, dtype=torch.long, device=device)
        self.inputs = DecodeInputs(self.input_ids, self.positions, self.slot_mapping,
                                   self.seq_lens, self.decode_order, self.block_tables)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # steps served by a graph (tests and benchmarks read it)

    def _meta(self, size: int) -> AttentionMetadata:
        # max_seq_len is the longest possible context, so the split count baked into the
        # graph suits every step it will replay
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.max_model_len, num_decode_tokens=size,
            decode_order=self.decode_order[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Records one graph per bucket, largest first, all sharing one memory pool."""
        pool = None
        for size in reversed(self.buckets):
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))
            self.forward(*args)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Frees the captured graphs (the replay counter stays). A graph that captured NCCL
        collectives keeps its communicator busy: destroying the process group before the
        graph hangs (pytorch/pytorch#115388), so ranks release their graphs first."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.buckets = []

    def can_replay(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Gives whether this step is a pure decode batch that fits a captured graph."""
        return (meta.max_query_len == 1 and kv_caches is self.kv_caches
                and bool(self.buckets) and meta.num_seqs <= self.buckets[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and meta.max_seq_len <= self.max_model_len)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Gives the hidden states [n, hidden] of an n-sequence decode step, run by a graph."""
        n = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= n)
        # the step's rows and the padding rows' slot -1, length 0 and own launch index (a
        # larger step's rows are left there) in one launch, not nine copies
        copy_decode_inputs(
            DecodeInputs(input_ids, positions, meta.slot_mapping, meta.seq_lens,
                         meta.decode_order, meta.block_tables), self.inputs, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]


def capture_decode_graphs(model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                          args: EngineArgs, max_model_len: int) -> DecodeGraphs | None:
    """Gives captured decode graphs of a model runner's model over its KV cache, or None
    where graphs do not apply.

    None on CPU, with ``--enforce-eager``, or with an attention backend that syncs
    with the host (the torch reference reads lengths back with ``tolist``).
    """
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    device = kv_caches[0].device
    if (device.type != "cuda" or args.enforce_eager
            or not isinstance(model.attn_backend, TritonAttentionBackend)):
        return None
    graphs = DecodeGraphs(model, kv_caches, args.max_num_seqs,
                          -(-max_model_len // args.block_size), max_model_len, device)
    graphs.capture()
    return graphs
