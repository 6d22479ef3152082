"""The KV connector seam, shaped like vLLM V1's `KVConnectorBase_V1`.

Scheduler side (inside `Scheduler.schedule`, on the engine thread):
`get_num_new_matched_tokens` says how many tokens of a waiting sequence, past its
GPU prefix hit, the connector holds elsewhere; the KV cache manager allocates
blocks for them like for computed tokens; `update_state_after_alloc` hands the
connector those blocks; `build_connector_meta` closes the step's plan (the loads,
and the blocks the GPU prefix cache evicted while allocating).

Worker side (in `LLMEngine.step`, after scheduling, before the forward):
`save_kv` copies the evicted blocks out, then `start_load_kv` writes the matched
blocks into their new slots and `wait_for_load` gives the sequences whose loads
failed (a checksum mismatch): those go back to their GPU hit and recompute the
rest. A load therefore always completes before the step that reads it, on the
engine's own thread: no other thread touches the block pool.

kvpilot runs both sides in one process (the model runner owns the caches), so one
object implements both; the metadata between them is still a typed value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.core.request import Sequence


@dataclass
class BlockLoad:
    """One sequence's blocks to fill from outside the GPU cache before its step."""

    seq: Sequence
    num_computed_before: int  # the sequence's GPU prefix hit, in tokens (where a failure resets it)
    block_ids: list[int]  # the freshly allocated slots, in position order
    hashes: list[int]  # the content hash each slot receives
    handle: list[int] = field(default_factory=list)  # the connector's pins on the source


@dataclass
class KVConnectorMetadata:
    """What the worker side does in one step: evicted blocks to save, matched blocks to load."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (block_id, block_hash)
    loads: list[BlockLoad] = field(default_factory=list)


@dataclass
class KVConnectorStats:
    """Cumulative counters of a connector, for /metrics."""

    external_queries: int = 0  # tokens of admitted sequences the connector was asked about
    external_hits: int = 0  # tokens it held (loaded instead of computed)
    saved_blocks: int = 0  # GPU blocks copied out (evicted from the prefix cache)
    loaded_blocks: int = 0  # blocks copied back in
    load_failures: int = 0  # blocks that failed their checksum (recomputed)
    dropped_blocks: int = 0  # blocks the full host tier could not take (recomputed if asked)
    evicted_blocks: int = 0  # host-tier entries dropped for room (LRU)
    host_usage: float = 0.0  # fraction of host-tier rows in use, 0..1
    host_blocks: int = 0  # host-tier capacity, in blocks

    def add_to(self, stats: EngineStats) -> None:
        """Sets the engine stats' connector fields (the server exports them) to these."""
        stats.external_prefix_cache_queries = self.external_queries
        stats.external_prefix_cache_hits = self.external_hits
        stats.kv_offload_saved_blocks = self.saved_blocks
        stats.kv_offload_loaded_blocks = self.loaded_blocks
        stats.kv_offload_failed_blocks = self.load_failures
        stats.kv_offload_dropped_blocks = self.dropped_blocks
        stats.kv_offload_evicted_blocks = self.evicted_blocks
        stats.kv_host_cache_usage = self.host_usage
        stats.kv_host_blocks = self.host_blocks


class KVConnector(ABC):
    """Finds and loads KV blocks held outside the GPU prefix cache; saves evicted ones."""

    # ---- scheduler side ---------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Gives how many tokens past the `num_computed_tokens` of the GPU hit the connector
        can load (at most up to the sequence's last token, which the step computes)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, num_computed_before: int,
                                 block_ids: list[int]) -> None:
        """Takes the slots allocated for the tokens the last match of `seq` promised."""

    @abstractmethod
    def on_evicted(self, block_id: int, block_hash: int) -> None:
        """Hears that the GPU prefix cache evicted a cached block (its data still in place
        until this step's forward)."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """Gives this step's saves and loads and forgets them (matches not followed by an
        allocation are dropped)."""

    # ---- worker side ------------------------------------------------------------------

    @abstractmethod
    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """Starts copying the evicted blocks out; runs before anything writes their slots."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Starts writing the matched blocks into their slots (after `save_kv`)."""

    @abstractmethod
    def wait_for_load(self) -> list[BlockLoad]:
        """Waits for the loads `start_load_kv` started; gives those that failed."""

    @abstractmethod
    def stats(self) -> KVConnectorStats:
        """Gives the counters so far."""
