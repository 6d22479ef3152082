"""Mixed steps as piecewise CUDA graphs: the layers between attentions replay, attention runs.

A step that mixes decodes with a prompt chunk (or a prompt tail, or a speculative
verify) cannot replay a decode graph (`cuda_graphs`): its attention depends on the
step's sequences, not only on its size. Run eagerly, the forward is bound by the host
(hundreds of launches from Python, 10-20x a graph replay of the same batch on an
H200). Everything outside attention, though, depends on the token count alone. So a
step of T tokens runs the graphs of the smallest captured bucket >= T, one graph per
stretch between two attentions (vLLM's piecewise mode):

    piece 0:   embed, rotary, layer 0's input norm, qkv, q/k norms, rotary (+ KV write)
    attention: layer 0 (eager: the backend launches for this step's sequences)
    piece i:   layer i-1's o_proj, norm, MLP; layer i up to its attention
    ...
    piece L:   layer L-1 after its attention, the final norm

The pieces read fixed buffers: the step's ids, positions and KV slots are copied in
(padding rows get slot -1, so they write no KV, and keep the stale ids and positions
of an earlier step: every row is computed on its own, so a padding row never reaches
a real one); each attention reads its piece's q/k/v and writes one shared output
buffer that the next piece reads. The LM head runs outside, as for decode graphs.

Every piece holds its q/k/v (the eager attention reads them at fixed addresses), so a
bucket costs about T x layers x (q + k + v) bytes of GPU memory; the start-up log says
how much. On CPU there are no graphs: `replay=False` calls the pieces themselves on
the same buffers each step, so the tests run the same path (padding, fixed buffers,
attention between pieces) as a GPU does.

Full graphs (the default on a GPU). Piecewise, a step still launches each layer's
attention from Python: about 0.35 ms a layer of host time on an H200 host, so a 0.6B-shaped
mixed step took 9-13 ms against a 2.5 ms decode replay
(bench/results/issue44-poisson-H200-2026-12-04/). With `full`, each bucket is ONE graph,
attention included: the attention is `kernels/unified_attention`, whose launch depends on
the token count and a fixed sequence capacity only, reading the step's query starts, lengths
and block tables from fixed buffers too (padding sequences: length 0). A step then costs its
input copies and one replay. `KVPILOT_PIECEWISE_GRAPHS=piecewise` keeps attention outside
(for side-by-side runs); on CPU, `=full` calls the same full path with the unified kernel
under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpilot.engine.models.llama import AttentionInputs, LlamaForCausalLM
    from kvpilot.engine.models.rope import StepRope

# "0": mixed steps run eagerly (the layout before, for side-by-side runs); "piecewise": a GPU
# keeps attention outside the graphs; "1" / "full": also on CPU, where the pieces are called
# rather than replayed (the tests' way onto the GPU's path), attention outside / unified
ENV = "KVPILOT_PIECEWISE_GRAPHS"
# the largest bucket: steps of more tokens run eagerly (their GEMMs outweigh the host's
# launch time) unless --max-num-batched-tokens is lower
MAX_TOKENS = 512
# the captured token counts (then MAX_TOKENS, or the budget when lower): dense where a few
# padded rows cost the most relative to the step
BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)


def token_buckets(max_tokens: int) -> list[int]:
    """Gives the captured token counts up to `max_tokens` (its last one is `max_tokens`)."""
    sizes = [n for n in BUCKETS if n < max_tokens]
    return [*sizes, max_tokens]


@dataclass
class _Bucket:
    """One token count's pieces: their graphs (none when called, not replayed), what each
    attention reads, and the final hidden states."""

    size: int
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    attention: list[AttentionInputs] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class PiecewiseGraphs:
    """Holds one bucket of pieces per token count and the fixed buffers they read."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 max_tokens: int, dtype: torch.dtype, device: torch.device, replay: bool,
                 prologue: Callable[[int], None] | None = None,
                 full: StaticBatch | None = None) -> None:
        self.model = model
        self.layers = model.model.decoder_layers()
        self.kv_caches = kv_caches
        self.replay = replay
        self.full = full  # the fixed metadata of full graphs; None: attention runs outside
        self.captured_bytes = 0  # GPU memory the full graphs' pool took
        self.prologue = prologue  # run first in piece 0 with the token count (LoRA's grouping)
        self.buckets = {n: _Bucket(n) for n in token_buckets(max_tokens)}
        self.max_tokens = max_tokens
        attn = self.layers[0].self_attn
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.attn_out = torch.zeros(max_tokens, attn.num_heads, attn.head_dim, dtype=dtype,
                                    device=device)

    # ---- the pieces ----------------------------------------------------------------------

    def _meta(self, size: int) -> AttentionMetadata:
        """Gives the metadata the pieces read: only the KV slots (the fused KV write); the
        attention between pieces gets the step's own."""
        empty = self.slot_mapping[:0].to(torch.int32)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=empty,
                                 seq_lens=empty, block_tables=empty.view(0, 0),
                                 max_query_len=0, max_seq_len=0)

    def _first(self, size: int, meta: AttentionMetadata
               ) -> tuple[StepRope, AttentionInputs, torch.Tensor]:
        """Gives piece 0's (rotary, layer 0's attention inputs, residual stream)."""
        if self.prologue is not None:
            self.prologue(size)
        decoder = self.model.model
        assert decoder.embed_tokens is not None  # a single stage
        x = decoder.embed_tokens(self.input_ids[:size])
        rope = decoder.rotary(self.positions[:size], x.dtype)
        step, stream = self.layers[0].attention_inputs(rope, x, None, self.kv_caches[0], meta)
        return rope, step, stream

    def _middle(self, i: int, size: int, rope: StepRope, stream: torch.Tensor,
                meta: AttentionMetadata) -> tuple[AttentionInputs, torch.Tensor]:
        """Gives piece i's (layer i's attention inputs, residual stream)."""
        x, stream = self.layers[i - 1].finish(self.attn_out[:size], stream)
        return self.layers[i].attention_inputs(rope, x, stream, self.kv_caches[i], meta)

    def _last(self, size: int, stream: torch.Tensor) -> torch.Tensor:
        """Gives the last piece's final hidden states [size, hidden]."""
        norm = self.model.model.norm
        assert norm is not None  # a single stage
        x, stream = self.layers[-1].finish(self.attn_out[:size], stream)
        return norm(x, stream)[0]

    def _pieces(self, bucket: _Bucket, record: Callable[[], AbstractContextManager[object]],
                attention: Callable[[int, AttentionInputs], None] | None = None
                ) -> tuple[list[AttentionInputs], torch.Tensor]:
        """Runs every piece of `bucket` once, each inside `record()` (a graph's capture, or
        nothing), and `attention(layer, inputs)` between them where given; gives what each
        attention reads and the final hidden states."""
        size, meta = bucket.size, self._meta(bucket.size)
        with record():
            rope, step, stream = self._first(size, meta)
        steps = [step]
        for i in range(1, len(self.layers)):
            if attention is not None:
                attention(i - 1, step)
            with record():
                step, stream = self._middle(i, size, rope, stream, meta)
            steps.append(step)
        if attention is not None:
            attention(len(self.layers) - 1, step)
        with record():
            hidden = self._last(size, stream)
        return steps, hidden

    # ---- capture and run -----------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Records every bucket's pieces (largest first, one memory pool), after a warm-up
        run of each bucket (Triton compiles, cuBLAS picks its kernels); with `replay` off,
        records nothing."""
        if not self.replay:
            return
        recorder = _Recorder()
        if self.full is not None:
            self._capture_full(recorder)
            return
        for bucket in sorted(self.buckets.values(), key=lambda b: -b.size):
            self._pieces(bucket, nullcontext)  # warm-up
            torch.cuda.synchronize()
            recorder.graphs = []
            bucket.attention, bucket.hidden = self._pieces(bucket, recorder.record)
            bucket.graphs = recorder.graphs
        torch.cuda.synchronize()

    @property
    def mode(self) -> str:
        """Gives "full" (attention inside the graphs) or "piecewise" (attention outside)."""
        return "full" if self.full is not None else "piecewise"

    def memory_bytes(self) -> int:
        """Gives the GPU memory the buckets hold (the start-up log's number): the full graphs'
        pool, or every piece's q/k/v."""
        if self.full is not None:
            return self.captured_bytes
        return sum(t.untyped_storage().nbytes() for b in self.buckets.values()
                   for s in b.attention[:1] for t in (s.q,)) * len(self.layers)

    def _capture_full(self, recorder: _Recorder) -> None:
        """Records each bucket as one graph, its attentions the unified kernel's over the fixed
        metadata (every sequence empty while capturing: the launches are what is recorded)."""
        before = torch.cuda.memory_reserved()
        for bucket in sorted(self.buckets.values(), key=lambda b: -b.size):
            attention = self._unified_attention(bucket.size)
            self._pieces(bucket, nullcontext, attention)  # warm-up: compiles, cuBLAS picks
            torch.cuda.synchronize()
            recorder.graphs = []
            with recorder.record():
                bucket.hidden = self._pieces(bucket, nullcontext, attention)[1]
            bucket.graphs = recorder.graphs
        torch.cuda.synchronize()
        self.captured_bytes = torch.cuda.memory_reserved() - before

    def _unified_attention(self, size: int) -> Callable[[int, AttentionInputs], None]:
        """Gives the attention between pieces of a full graph of `size` tokens: the KV write
        (unless fused) and `unified_attention` over the fixed metadata into the shared output."""
        from kvpilot.kernels.kv_cache_write import kv_cache_write
        from kvpilot.kernels.unified_attention import unified_attention

        full, out, slots = self.full, self.attn_out[:size], self.slot_mapping[:size]
        assert full is not None

        def attention(layer: int, step: AttentionInputs) -> None:
            attn, cache = self.layers[layer].self_attn, self.kv_caches[layer]
            if not step.kv_written:
                kv_cache_write(step.k, step.v, cache, slots, attn.kv_scales)
            unified_attention(step.q, cache, full.block_tables, full.query_start_loc,
                              full.seq_lens, attn.scale, out, attn.kv_scales)

        return attention

    def release(self) -> None:
        """Frees the captured graphs; later mixed steps run eagerly."""
        if self.replay:
            torch.cuda.synchronize()
        for bucket in self.buckets.values():
            for graph in bucket.graphs:
                graph.reset()
        self.buckets = {}

    def can_run(self, num_tokens: int, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> bool:
        """Gives whether a step of `num_tokens` tokens over `kv_caches` fits a bucket (and,
        for full graphs, its sequences and block tables fit the fixed metadata)."""
        return bool(self.buckets) and num_tokens <= self.max_tokens \
            and kv_caches is self.kv_caches \
            and (self.full is None or self.full.fits(meta))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Gives the hidden states [n, hidden] of an n-token step: the bucket's pieces, and
        between them each layer's attention over the step's own sequences."""
        n = input_ids.shape[0]
        bucket = self.buckets[next(size for size in self.buckets if size >= n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bucket.size].fill_(-1)
        if self.full is not None:
            self.full.copy_in(meta, n)
            if not self.replay:  # the same graph's work, called
                return self._pieces(bucket, nullcontext, self._unified_attention(bucket.size)
                                    )[1][:n]
            bucket.graphs[0].replay()
            assert bucket.hidden is not None
            return bucket.hidden[:n]
        backend, out = self.model.attn_backend, self.attn_out[:n]

        def attention(layer: int, step: AttentionInputs) -> None:
            attn = self.layers[layer].self_attn
            backend.forward(step.q[:n], step.k[:n], step.v[:n], self.kv_caches[layer], meta,
                            attn.scale, attn.kv_scales, kv_written=step.kv_written, out=out)

        if not self.replay:  # the same pieces, called
            return self._pieces(bucket, nullcontext, attention)[1][:n]
        for layer, (graph, step) in enumerate(zip(bucket.graphs, bucket.attention,
                                                  strict=False)):
            graph.replay()
            attention(layer, step)
        bucket.graphs[-1].replay()
        assert bucket.hidden is not None
        return bucket.hidden[:n]


class StaticBatch:
    """The fixed query starts, lengths and block tables that full graphs' attention reads,
    for up to `max_seqs` sequences of up to `max_blocks` blocks: a step's are copied in, the
    rest are padding sequences (length 0, starting at the step's last token)."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Gives whether `meta`'s sequences and block tables fit the buffers."""
        return meta.num_seqs <= self.seq_lens.shape[0] \
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]

    def copy_in(self, meta: AttentionMetadata, num_tokens: int) -> None:
        """Copies a step of `num_tokens` tokens' metadata in; later sequences become padding
        (the kernel reads a sequence's table only below its length: stale rows are unread)."""
        seqs, width = meta.num_seqs, meta.block_tables.shape[1]
        self.query_start_loc[:seqs + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[seqs + 1:].fill_(num_tokens)
        self.seq_lens[:seqs].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[seqs:].zero_()
        self.block_tables[:seqs, :width].copy_(meta.block_tables, non_blocking=True)


class _Recorder:
    """Records pieces into CUDA graphs that share one memory pool, on a side stream."""

    def __init__(self) -> None:
        self.side = torch.cuda.Stream()
        self.first: torch.cuda.CUDAGraph | None = None  # its pool is every graph's
        self.graphs: list[torch.cuda.CUDAGraph] = []

    @contextmanager
    def record(self) -> Iterator[None]:
        """Records what runs inside into a new graph (without torch.cuda.graph's garbage
        collection and cache flush on entry: a second a bucket with the model loaded)."""
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            graph.capture_begin(pool=self.first.pool() if self.first is not None else None)
            try:
                yield
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.side)
        self.first = self.first or graph
        self.graphs.append(graph)


def piecewise_mode(device: torch.device) -> tuple[str, bool]:
    """Gives how mixed steps run on `device`: ("replay" (CUDA graphs), "call" (the pieces
    called: CPU with KVPILOT_PIECEWISE_GRAPHS=1 or full) or "off"), and whether attention
    is inside the graphs (full: the GPU's default, or =full)."""
    value = os.environ.get(ENV, "")
    if value == "0":
        return "off", False
    if device.type == "cuda":
        return "replay", value not in ("piecewise", "1")
    return ("call", value == "full") if value in ("1", "full") else ("off", False)
