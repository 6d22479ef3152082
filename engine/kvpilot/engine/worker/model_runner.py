"""Runs the model on one scheduled step: owns the paged KV cache and the model (or one
tensor-parallel rank's shard of both, for the layers of its pipeline stage).

The batch is the layout of `engine/attention/metadata.py`, packed into one int64
buffer by `step_batch.pack_step` (numpy, no per-token Python loops) and read back
as device views by `step_batch.unpack_step`. Only the rows that sample (or that
need prompt logprobs) go through the LM head.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.contracts.args import EngineArgs, parse_size
from kvpilot.engine.contracts.nixl_memory import nixl_device_bytes
from kvpilot.engine.lora.layers import LoRAModel
from kvpilot.engine.parallel.groups import SINGLE_RANK, TPGroup
from kvpilot.engine.parallel.stage import Intermediate, PipelineStage
from kvpilot.engine.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs
from kvpilot.engine.worker.device import StagingBuffer, limit_host_threads
from kvpilot.engine.worker.piecewise_graphs import (
    MAX_TOKENS,
    PiecewiseGraphs,
    StaticBatch,
    piecewise_mode,
)
from kvpilot.engine.worker.startup_log import LoadReport
from kvpilot.engine.worker.step_batch import (
    BatchEntry,
    PackedStep,
    StepInputs,
    pack_step,
    unpack_step,
)
from kvpilot.kernels.kv_cache_dtype import as_bytes

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.models.llama import LlamaForCausalLM

CPU_KV_CACHE_DEFAULT = "256MiB"


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
    """Holds the model and its KV cache (this rank's shards); executes steps.

    `agree_num_blocks` turns this rank's KV block count into the one it uses: with tensor or
    pipeline parallelism the smallest of every rank's, with a draft model its share of the
    budget. A pipeline `stage` holds the KV cache of its layers only, and runs eagerly (no
    CUDA graphs yet).
    """

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device,
                 tp: TPGroup = SINGLE_RANK,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 stage: PipelineStage | None = None,
                 model: LlamaForCausalLM | None = None) -> None:
        from kvpilot.engine.models.loader import load_model
        from kvpilot.engine.quantization.config import (
            check_device,
            resolve_kv_cache_dtype,
            resolve_quantization,
        )

        limit_host_threads(device)
        self.args = args
        self.config = model_config
        self.device = device
        self.block_size = args.block_size
        self.stage = stage or PipelineStage.whole(model_config.num_layers)
        check_device(resolve_quantization(args.quantization, model_config.hf_config,
                                          model_config.architecture), device)
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, model_config.dtype, device)
        started = time.perf_counter()
        # a model given is already loaded (a draft model, loaded before the target sizes the
        # KV cache so the profile sees its weights)
        self.model = model if model is not None else load_model(
            model_config, args.load_format, device, seed=args.seed, tp=tp, stage=self.stage,
            quantization=args.quantization)
        self.load_seconds = time.perf_counter() - started
        self.model.attn_backend = select_attention_backend(args, device)
        # LoRA slots before the KV cache is sized, so the GPU profile counts them
        self.lora = LoRAModel(self.model, args.max_loras, args.max_lora_rank,
                              args.max_num_batched_tokens, device, model_config.dtype) \
            if args.enable_lora else None
        kv_heads = tp.kv_heads(model_config.num_kv_heads)
        self.num_kv_heads = kv_heads.stop - kv_heads.start  # this rank's
        self.decode_graphs: DecodeGraphs | None = None  # set once the KV cache exists
        self.mixed_graphs: PiecewiseGraphs | None = None  # likewise: mixed steps' pieces
        self._staging = StagingBuffer(device)  # the packed step's host buffer
        # forwards run by a decode graph, by piecewise graphs (mixed steps) and eagerly
        # (longer steps, pipeline stages, CPU, start-up)
        self.num_graph_steps = 0
        self.num_piecewise_steps = 0
        self.num_eager_steps = 0
        self.num_blocks = self._num_kv_blocks()
        if agree_num_blocks is not None:
            self.num_blocks = agree_num_blocks(self.num_blocks)
        self.kv_caches = self._new_caches(self.num_blocks)
        started = time.perf_counter()
        if self.stage.size == 1:
            self.decode_graphs = capture_decode_graphs(self.model, self.kv_caches, args,
                                                       model_config.max_model_len)
            if self.decode_graphs is not None:
                self._warm_logits(args.max_num_seqs)
            self.mixed_graphs = self._capture_mixed_graphs()
        self.graph_seconds = time.perf_counter() - started

    def _capture_mixed_graphs(self) -> PiecewiseGraphs | None:
        """Gives the mixed steps' graphs (`piecewise_graphs`: full on a GPU, attention
        inside), or None where they do not apply: KVPILOT_PIECEWISE_GRAPHS=0, --enforce-eager,
        a mixture of experts (its captured path runs every expert on every token), or CPU
        unless the variable is 1 or full."""
        from kvpilot.engine.models.llama import MLP

        mode, full = piecewise_mode(self.device)
        decoder = self.model.model
        if mode == "off" or self.args.enforce_eager or not all(
                isinstance(layer.mlp, MLP) for layer in decoder.decoder_layers()):
            return None
        if mode == "replay" and self.decode_graphs is None:
            return None  # the torch attention backend syncs with the host
        graphs = PiecewiseGraphs(
            self.model, self.kv_caches, min(MAX_TOKENS, self.args.max_num_batched_tokens),
            self.config.dtype, self.device, replay=mode == "replay",
            prologue=self.lora.group_tokens if self.lora is not None else None,
            full=StaticBatch(self.args.max_num_seqs,
                             -(-self.config.max_model_len // self.block_size), self.device)
            if full else None)
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def _warm_logits(self, max_rows: int) -> None:
        """Runs the LM head (eager, outside the decode graphs) once per decode row count.

        The first GEMM of a row count costs: on an H100 (Qwen3-0.6B shape, 256
        streams) a served batch shrinking one request at a time had one decode
        step of 12-17 ms instead of ~9 every ~30 steps (at 232, 208, 176 ... rows),
        every stream's ITL at once; with this warm-up none. Not CUDA's lazy kernel
        loading: with CUDA_MODULE_LOADING=EAGER they stayed. Start-up takes ~0.1 s
        for a 150k vocabulary at 256 rows.
        """
        hidden = torch.zeros(max_rows, self.config.hidden_size, dtype=self.config.dtype,
                             device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return (2 * self.block_size * self.num_kv_heads * cfg.head_dim * elem
                * len(self.stage.layers))

    def load_report(self) -> LoadReport:
        """Gives what this rank loaded and sized while starting (the start-up log's numbers)."""
        graphs, mixed = self.decode_graphs, self.mixed_graphs
        return LoadReport(sum(p.numel() * p.element_size() for p in self.model.parameters()),
                          self.load_seconds, self.num_blocks, self.block_size,
                          self.bytes_per_block, tuple(graphs.buckets) if graphs else None,
                          self.graph_seconds,
                          tuple(mixed.buckets) if mixed is not None and mixed.replay else (),
                          mixed.memory_bytes() if mixed is not None else 0,
                          mixed.mode if mixed is not None else "full")

    def _new_caches(self, num_blocks: int) -> list[torch.Tensor]:
        cfg = self.config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                for _ in self.stage.layers]

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
        scratch = self._new_caches(num_blocks)
        packed, buf = self.pack([BatchEntry([0] * num_tokens, 0, list(range(num_blocks)))], [])
        step = unpack_step(packed.header, buf, packed.host)
        if self.stage.size == 1:
            self.run(step, kv_caches=scratch)
        else:  # the activations a middle or last stage would receive
            hidden = torch.zeros(num_tokens, self.config.hidden_size, dtype=self.config.dtype,
                                 device=self.device)
            received = None if self.stage.is_first else Intermediate(hidden, hidden.clone())
            self.run_stage(step, received, kv_caches=scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        nixl = nixl_device_bytes(self.args)  # its send region or landing pool, made later
        # a long prompt's later chunks gather one layer's cached keys at a time (decision 0140)
        from kvpilot.kernels.paged_prefill_attention import gather_reserve_bytes  # (Triton)

        gather = gather_reserve_bytes(
            self.device, self.kv_dtype, self.bytes_per_block // (self.block_size * len(
                self.stage.layers)), self.args.max_num_seqs * self.config.max_model_len)
        free_bytes = int(total * self.args.gpu_memory_utilization) - peak - nixl - gather
        if free_bytes < self.bytes_per_block:
            beside = "".join(f" and {size / 2**30:.1f} GiB of {what}" for size, what in (
                (nixl, "NIXL buffers"), (gather, "keys gathered for long prompts")) if size)
            raise ValueError(f"gpu_memory_utilization={self.args.gpu_memory_utilization} leaves no "
                             f"room for the KV cache after the model{beside}: raise it or lower "
                             "max_num_batched_tokens")
        return free_bytes // self.bytes_per_block

    def pack(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
             prev_tokens: torch.Tensor | None = None) -> tuple[PackedStep, torch.Tensor]:
        """Gives the step packed on the host and its buffer on the device (one copy)."""
        packed = pack_step(entries, copies, self.block_size, self._staging,
                           0 if prev_tokens is None else int(prev_tokens.shape[0]))
        return packed, self._staging.upload(packed.host_tensor)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Gives the hidden states of one flat batch (decode steps replay a CUDA graph, mixed
        steps of up to MAX_TOKENS tokens their mixed graphs)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(meta, kv_caches):
            self.num_graph_steps += 1
            return graphs.replay(input_ids, positions, meta)
        mixed = self.mixed_graphs
        if mixed is not None and mixed.can_run(input_ids.shape[0], kv_caches, meta):
            self.num_piecewise_steps += 1
            return mixed.run(input_ids, positions, meta)
        self.num_eager_steps += 1
        return self.model(input_ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def run(self, step: StepInputs, prev_tokens: torch.Tensor | None = None,
            kv_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs an unpacked step: block copies, patches, forward; gives its logits rows
        (model dtype, [rows, vocab] on tensor-parallel rank 0)."""
        caches = self.kv_caches if kv_caches is None else kv_caches
        input_ids = self._prepare(step, prev_tokens, caches)
        hidden = self.forward(input_ids, step.positions, step.meta, caches)
        return self._logits(step, hidden)

    @torch.inference_mode()
    def run_stage(self, step: StepInputs, received: Intermediate | None,
                  kv_caches: list[torch.Tensor] | None = None) -> Intermediate | torch.Tensor:
        """Runs an unpacked step through this pipeline stage's layers (`received`: the
        previous stage's activations, None on the first); gives the activations for the
        next stage, or on the last stage its logits rows (as `run` does)."""
        caches = self.kv_caches if kv_caches is None else kv_caches
        input_ids = self._prepare(step, None, caches)
        self.num_eager_steps += 1
        out = self.model.forward_stage(input_ids, step.positions, caches, step.meta, received)
        return out if isinstance(out, Intermediate) else self._logits(step, out)

    def _prepare(self, step: StepInputs, prev_tokens: torch.Tensor | None,
                 caches: list[torch.Tensor]) -> torch.Tensor:
        """Copies the step's shared blocks and patches its in-flight tokens; gives its ids."""
        if step.copies is not None:  # copy-on-write of shared blocks before the step writes
            src, dst = step.copies
            for cache in map(as_bytes, caches):  # fp8 rows move as bytes (CPU indexing)
                cache[:, dst] = cache[:, src]
        input_ids = step.input_ids
        if step.patches is not None:
            if prev_tokens is None:
                raise ValueError("entries have patch_row set but no prev_tokens were given")
            positions_to_patch, sampled_rows = step.patches
            input_ids[positions_to_patch] = prev_tokens[sampled_rows]
        return input_ids

    def _logits(self, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """Gives the logits (model dtype) of the step's rows that sample (or score the prompt)."""
        if not step.header.num_rows:
            return hidden.new_empty((0, self.config.vocab_size))
        if step.rows is None:
            # every row samples (a decode step): skip the gather
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden.index_select(0, step.rows))

    def execute(self, entries: list[BatchEntry], copies: list[tuple[int, int]],
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step; gives logits (model dtype) for the rows `entries` ask for, in entry order.

        `prev_tokens` are the sampled ids of the step still in flight; entries with
        `patch_row` take their last input token from it on the device.
        """
        packed, buf = self.pack(entries, copies, prev_tokens)
        if self.lora is not None:
            self.lora.mapping.set(np.repeat([e.lora_slot for e in entries],
                                            [len(e.token_ids) for e in entries]))
        return self.run(unpack_step(packed.header, buf, packed.host), prev_tokens)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Keeps nothing: a single-rank runner has no processes to lose between steps."""

    def release_graphs(self) -> None:
        """Frees the captured graphs; later steps run eagerly."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()

    def shutdown(self) -> None:
        """Stops nothing: a single-rank runner has no processes of its own."""
