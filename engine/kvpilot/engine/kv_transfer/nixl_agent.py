"""A NIXL agent beside an engine's KV agent: registers memory once, meets peers through
metadata the authenticated TCP channel carries, and reads block groups with bounded waits.

NIXL (`pip install 'kvpilot-engine[nixl]'`, or a `nixl_cu12`/`nixl_cu13` wheel) moves
the bytes: a prefill engine registers its per-layer KV caches (VRAM on a GPU, DRAM on
a CPU engine) and sends its agent metadata and cache layout in the LEASE frame; the
decode engine's agent adds it as a remote agent and READs the wanted blocks into its
registered receive buffers (`nixl_layout.read_descriptors`). No NIXL listener runs:
metadata only travels over the KV agent's connection, after its HMAC handshake, so
nothing is read from a peer that did not prove the fleet's secret.
"""

from __future__ import annotations

import base64
import importlib
import logging
import threading
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvpilot.engine.contracts.kv_protocol import ProtocolError
from kvpilot.engine.kv_transfer.nixl_layout import CacheLayout, read_descriptors

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
        """READs the peer's blocks `block_ids` into rows `at` (default 0, 1, ...) of `rows`
        (uint8 [capacity, block_bytes] in host or GPU memory: a receive buffer, the host
        tier's rows) as one transfer, waiting at most `timeout` seconds.

        Raises NixlError when the transfer fails, NixlTimeout when it is still running at
        the deadline (then `rows` must not be reused: the peer may still write them).
        """
        if rows.shape[1] != layout.block_bytes:
            raise ProtocolError(f"the peer's blocks are {layout.block_bytes} bytes, this "
                                f"engine's {rows.shape[1]}: a different model, dtype or "
                                "block size")
        mem, device = _memory_of(rows)
        base = rows.untyped_storage()
        self._register_storage(base.data_ptr(), base.nbytes(), mem, device)
        indices = range(len(block_ids)) if at is None else at
        row_ptrs = [rows.data_ptr() + i * rows.shape[1] for i in indices]
        local, remote = read_descriptors(layout, block_ids, row_ptrs, device)
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
            raise NixlTimeout(f"NIXL READ of {len(block_ids)} blocks from {peer!r} ran past "
                              f"its {timeout:.1f} s")
        if state != "DONE":
            raise NixlError(f"NIXL READ of {len(block_ids)} blocks from {peer!r} failed "
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


def make_agent(name: str, caches: list[torch.Tensor] | None = None) -> NixlAgent | None:
    """Gives a NIXL agent with `caches` registered (a prefill engine's), or None when nixl
    does not load or cannot register them (logged: the KV agent then moves blocks by TCP)."""
    try:
        agent = NixlAgent(name)
    except NixlUnavailable as exc:
        log.warning("--kv-transport nixl: %s; KV moves over TCP", exc)
        return None
    if caches is not None:
        try:
            agent.register_caches(caches)
        except Exception as exc:  # nixl's own errors, e.g. a UCX without CUDA support
            log.warning("--kv-transport nixl: cannot register the KV caches with NIXL (%r); "
                        "KV moves over TCP", exc)
            agent.close()
            return None
    return agent
