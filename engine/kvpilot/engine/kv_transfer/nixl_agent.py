"""A NIXL agent beside an engine's KV agent: registers memory once, meets peers through
metadata the authenticated TCP channel carries, and reads block groups with bounded waits.

NIXL (`pip install 'kvpilot-engine[nixl]'`, or a `nixl_cu12`/`nixl_cu13` wheel) moves
the bytes: a prefill engine registers its per-layer KV caches (VRAM on a GPU, DRAM on
a CPU engine) and sends its agent metadata and cache layout in the LEASE frame; the
decode engine's agent adds it as a remote agent and READs the wanted blocks, packed by the
prefill side into its send region (`nixl_region`, `read_rows`) or else straight from its
caches (`read`), into registered rows of its own. No NIXL listener runs:
metadata only travels over the KV agent's connection, after its HMAC handshake, so
nothing is read from a peer that did not prove the fleet's secret.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import logging
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpilot.engine.contracts.kv_protocol import ProtocolError
from kvpilot.engine.contracts.nixl_memory import SEND_REGION_BYTES
from kvpilot.engine.kv_transfer.nixl_layout import (
    CacheLayout,
    read_descriptors,
    region_descriptors,
)
from kvpilot.engine.kv_transfer.nixl_region import SendRegion

if TYPE_CHECKING:
    import torch  # only tensors' own methods are called: the agent imports without torch

log = logging.getLogger("kvpilot.kv_transfer")
# the meta package `nixl` picks its CUDA variant; a variant wheel installed alone is used as is
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
BACKEND = "UCX"
POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # transfer-state polls back off between these


class NixlUnavailable(Exception):
    """NIXL cannot be used in this process (not installed, or no UCX backend)."""


class NixlError(ProtocolError):
    """A NIXL connection or transfer failed; the pull is retried over TCP."""


class NixlTimeout(NixlError):
    """A READ did not finish by its deadline: its destination buffer may still be written."""


def nixl_api() -> ModuleType:
    """Gives nixl's `_api` module, or raises NixlUnavailable naming what was tried and the fix."""
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except (ImportError, OSError) as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("nixl is not importable (install the engine's `nixl` extra, "
                          "pip install 'kvpilot-engine[nixl]'): " + "; ".join(errors))


class NixlAgent:
    """One engine's NIXL agent (UCX backend, progress thread, no listener); thread-safe."""

    def __init__(self, name: str, api: ModuleType | None = None) -> None:
        api = api or nixl_api()
        self.name = name
        self._lock = threading.Lock()  # the agent is made without NIXL's own thread sync
        self._agent: Any = api.nixl_agent(name, api.nixl_agent_config(True, False, 0,
                                                                      backends=[BACKEND]))
        if BACKEND not in self._agent.backends:
            raise NixlUnavailable(f"nixl has no {BACKEND} backend here (plugins: "
                                  f"{self._agent.get_plugin_list()})")
        self.layout: CacheLayout | None = None  # set by register_caches (prefill side)
        self.region: SendRegion | None = None  # set by register_region (prefill side)
        self._registered: dict[int, Any] = {}  # base address -> registration
        self._peers: dict[str, bytes] = {}  # remote agent name -> its metadata

    # ---- prefill side -------------------------------------------------------------------

    def register_caches(self, caches: list[torch.Tensor]) -> CacheLayout:
        """Registers an engine's per-layer caches ([2, num_blocks, ...] each, contiguous) and
        gives their layout."""
        first = caches[0]
        if any(not c.is_contiguous() or c.shape != first.shape for c in caches):
            raise ValueError("NIXL needs contiguous per-layer KV caches of one shape")
        mem, device = _memory_of(first)
        for cache in caches:
            self._register(cache, mem, device)
        self.layout = CacheLayout(mem, device, tuple(c.data_ptr() for c in caches),
                                  first.shape[1], first[0, 0].numel() * first.element_size())
        return self.layout

    def register_region(self, rows: torch.Tensor) -> SendRegion:
        """Registers `rows` (uint8 [n, block_bytes], beside the caches) as the send region a
        pull's blocks are packed into; gives the region."""
        if self.layout is None:
            raise RuntimeError("NixlAgent.register_region before register_caches")
        if rows.dim() != 2 or rows.shape[1] != self.layout.block_bytes:
            raise ValueError(f"send region rows {tuple(rows.shape)} are not "
                             f"[n, {self.layout.block_bytes}]")
        mem, device = _memory_of(rows)
        self._register(rows, mem, device)
        self.region = SendRegion(rows)
        self.layout = dataclasses.replace(self.layout, region_ptr=rows.data_ptr(),
                                          region_rows=rows.shape[0])
        return self.region

    def offer(self) -> dict[str, Any]:
        """Gives what a LEASE frame carries for a decode side to read this engine's caches."""
        if self.layout is None:
            raise RuntimeError("NixlAgent.offer before register_caches")
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return {"agent": self.name, "metadata": base64.b64encode(metadata).decode(),
                "layout": self.layout.to_message()}

    # ---- decode side --------------------------------------------------------------------

    def connect(self, offer: dict[str, Any]) -> tuple[str, CacheLayout]:
        """Adds the peer a LEASE frame's `nixl` part names (once per peer); gives its agent
        name and cache layout. Raises NixlError when it cannot be added."""
        layout = CacheLayout.from_message(offer.get("layout") or {})
        try:
            name, metadata = str(offer["agent"]), base64.b64decode(offer["metadata"])
        except (KeyError, ValueError) as exc:
            raise NixlError(f"the peer's NIXL offer is malformed: {exc!r}") from exc
        with self._lock:
            if self._peers.get(name) != metadata:
                try:
                    if name in self._peers:  # the same agent with new registrations
                        self._agent.remove_remote_agent(name)
                        del self._peers[name]
                    added = self._agent.add_remote_agent(metadata)
                except Exception as exc:  # nixl raises its own error types from C++
                    raise NixlError(f"cannot add NIXL agent {name!r}: {exc!r}") from exc
                if (added.decode() if isinstance(added, bytes) else added) != name:
                    raise NixlError(f"the peer's NIXL metadata names agent {added!r}, "
                                    f"its offer {name!r}")
                self._peers[name] = metadata
        return name, layout

    def read(self, peer: str, layout: CacheLayout, block_ids: list[int], rows: torch.Tensor,
             timeout: float, at: list[int] | None = None) -> None:
        """READs the peer's cache blocks `block_ids` into rows `at` (default 0, 1, ...) of
        `rows` (uint8 [capacity, block_bytes] in host or GPU memory: a receive buffer, the
        host tier's rows) as one transfer, waiting at most `timeout` seconds.

        Raises NixlError when the transfer fails, NixlTimeout when it is still running at
        the deadline (then `rows` must not be reused: the peer may still write them).
        """
        mem, device = self._local(layout, rows)
        indices = range(len(block_ids)) if at is None else at
        row_ptrs = [rows.data_ptr() + i * rows.shape[1] for i in indices]
        local, remote = read_descriptors(layout, block_ids, row_ptrs, device)
        self._read(peer, layout, local, mem, remote, timeout, len(block_ids))

    def read_rows(self, peer: str, layout: CacheLayout, region_rows: list[int],
                  rows: torch.Tensor, timeout: float, at: list[int] | None = None) -> None:
        """READs rows `region_rows` of the peer's send region (blocks it packed for this
        pull) into rows `at` (default 0, 1, ...) of `rows`, one descriptor per run of
        consecutive rows; raises as `read` does."""
        mem, device = self._local(layout, rows)
        indices = list(range(len(region_rows))) if at is None else at
        local, remote = region_descriptors(layout, region_rows, rows.data_ptr(), indices,
                                           device)
        self._read(peer, layout, local, mem, remote, timeout, len(region_rows))

    def register_rows(self, rows: torch.Tensor) -> tuple[str, int]:
        """Registers the storage of `rows` that READs land in (once; a decode engine's
        landing rows at start-up, else at their first READ); gives its NIXL memory type
        and device."""
        mem, device = _memory_of(rows)
        base = rows.untyped_storage()
        self._register_storage(base.data_ptr(), base.nbytes(), mem, device)
        return mem, device

    def _local(self, layout: CacheLayout, rows: torch.Tensor) -> tuple[str, int]:
        """Gives `rows`' NIXL memory type and device, registered, checking their size."""
        if rows.shape[1] != layout.block_bytes:
            raise ProtocolError(f"the peer's blocks are {layout.block_bytes} bytes, this "
                                f"engine's {rows.shape[1]}: a different model, dtype or "
                                "block size")
        return self.register_rows(rows)

    def _read(self, peer: str, layout: CacheLayout, local: Any, mem: str, remote: Any,
              timeout: float, blocks: int) -> None:
        """Runs one READ of descriptor arrays `local` <- `remote`, waiting until `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            handle = None
            try:
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, mem),
                    self._agent.get_xfer_descs(remote, layout.mem), peer)
                state = self._agent.transfer(handle)
            except Exception as exc:  # nixl raises its own error types (a dead peer's too)
                if handle is not None:
                    self._agent.release_xfer_handle(handle)
                raise NixlError(f"NIXL READ from {peer!r} could not start: {exc!r}") from exc
        pause = POLL_MIN_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        with self._lock:
            if state != "PROC":
                self._agent.release_xfer_handle(handle)
        if state == "PROC":
            raise NixlTimeout(f"NIXL READ of {blocks} blocks from {peer!r} ran past "
                              f"its {timeout:.1f} s")
        if state != "DONE":
            raise NixlError(f"NIXL READ of {blocks} blocks from {peer!r} failed "
                            f"(state {state})")

    # ---- registrations ------------------------------------------------------------------

    def _register(self, tensor: torch.Tensor, mem: str, device: int) -> None:
        size = tensor.numel() * tensor.element_size()
        self._register_storage(tensor.data_ptr(), size, mem, device)

    def _register_storage(self, address: int, size: int, mem: str = "DRAM",
                          device: int = 0) -> None:
        with self._lock:
            if address in self._registered:
                return
            self._registered[address] = self._agent.register_memory(
                [(address, size, device, "")], mem)

    def close(self) -> None:
        """Forgets the peers and drops every registration."""
        with self._lock:
            for name in self._peers:
                self._agent.remove_remote_agent(name)
            self._peers.clear()
            for registration in self._registered.values():
                self._agent.deregister_memory(registration)
            self._registered.clear()


def _memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """Gives NIXL's memory type and device id for a tensor's memory."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)


def make_agent(name: str, caches: list[torch.Tensor] | None = None,
               landing: torch.Tensor | None = None) -> NixlAgent | None:
    """Gives a NIXL agent with `caches` (a prefill engine's) and a send region, or a decode
    engine's `landing` rows, registered; or None when nixl does not load or cannot register
    them (logged: the KV agent then moves blocks by TCP)."""
    try:
        agent = NixlAgent(name)
    except NixlUnavailable as exc:
        log.warning("--kv-transport nixl: %s; KV moves over TCP", exc)
        return None
    try:  # at start-up: a failure shows here, not as a failed first pull
        if landing is not None:
            agent.register_rows(landing)
        if caches is not None:
            layout = agent.register_caches(caches)
            rows = min(layout.num_blocks, max(1, SEND_REGION_BYTES // layout.block_bytes))
            agent.register_region(_empty_rows(caches[0], rows, layout.block_bytes))
            log.info("NIXL send region: %d rows of %d bytes (%.2f GiB) on %s", rows,
                     layout.block_bytes, rows * layout.block_bytes / 2**30, caches[0].device)
    except Exception as exc:  # nixl's own errors, e.g. a UCX without CUDA support
        log.warning("--kv-transport nixl: cannot register the KV %s with NIXL (%r); KV "
                    "moves over TCP", "caches" if caches is not None else "landing rows", exc)
        agent.close()
        return None
    return agent


def _empty_rows(like: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
    """Gives uint8 [rows, row_bytes] on `like`'s device (a prefill engine's send region)."""
    import torch

    return torch.empty((rows, row_bytes), dtype=torch.uint8, device=like.device)
