"""`--role prefill|decode`: an LLMEngine with a KV agent beside it.

`attach_role` wraps the engine the server drives. As a prefill engine, every
request that finishes normally offers its prompt's blocks under a lease (keyed
by the request id the OpenAI response carries as `id`); the wrapper takes the
block store's lock around every engine call, so the KV agent's thread (pinning
and reading leased blocks) never runs during a step. A decode engine's agent
lands pulled blocks in the engine's host tier (`kv_connector.landing_store`),
without the engine lock; the request the router sends next finds them through
the KV connector, and its step loads them before its forward. Generation itself
is unchanged, which is why a disaggregated answer equals the aggregated one
token for token.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from kvpilot.engine.contracts.args import KV_PORT_OFFSET, EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.engine_loop.engine_core import ModelLimits, ServedEngine
from kvpilot.engine.kv_transfer.connector import KVTransport

if TYPE_CHECKING:
    import torch

    from kvpilot.engine.engine_loop.llm_engine import LLMEngine
    from kvpilot.engine.kv_connector.landing_store import LandingStore
    from kvpilot.engine.kv_transfer.nixl_agent import NixlAgent

log = logging.getLogger("kvpilot.roles")
LEASE_SECONDS_ENV = "KVPILOT_KV_LEASE_SECONDS"
DEFAULT_LEASE_SECONDS = 30.0
ROLE_SWITCH_INTERVAL_S = 0.001


class RoleEngine:
    """Serves an engine under the block store's lock; a prefill one leases its finished
    prompts' blocks."""

    def __init__(self, engine: ServedEngine, connector: KVTransport, role: str,
                 lock: AbstractContextManager[object]) -> None:
        self.engine, self.connector, self.role, self.lock = engine, connector, role, lock
        self._lock_wait_s = 0.0
        # a prefill engine's live requests' prompt ids, which it leases when they finish
        self._prompts: dict[str, list[int]] = {}

    @property
    def engine_args(self) -> EngineArgs:
        return self.engine.engine_args

    @property
    def model_config(self) -> ModelLimits:
        return self.engine.model_config

    @property
    def tokenizer(self) -> TokenizerLike:
        return self.engine.tokenizer

    @property
    def kv_events(self) -> KVEventLog:
        """Gives the engine's event log (read without the lock, see `core.kv_events`)."""
        return self.engine.kv_events

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        with self.lock:
            self.engine.add_request(request_id, prompt, params, arrival_time, priority,
                                    lora_name)
        if self.role == "prefill":
            self._prompts[request_id] = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                                         else prompt)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        with self.lock:
            self.engine.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        with self.lock:
            stats = self.engine.get_stats()
        stats.kv_transport, stats.kv_pulls = self.connector.transport, dict(self.connector.pulls)
        return stats

    def step(self) -> list[EngineCoreOutput]:
        asked = time.perf_counter()
        with self.lock:
            self._lock_wait_s = time.perf_counter() - asked
            outputs = self.engine.step()
            if self.role == "prefill":
                for output in outputs:
                    if not output.finished:
                        continue
                    prompt = self._prompts.pop(output.request_id, None)
                    if prompt is not None and all(c.finish_reason in ("stop", "length")
                                                  for c in output.completions):
                        self.connector.offer(output.request_id, prompt)
        return outputs

    def step_timing(self) -> str:
        """Says where the last step waited (for the slow-iteration log)."""
        return (f"lock wait {self._lock_wait_s * 1e3:.1f} ms, {self.engine.step_timing()}, "
                f"KV transfers running {self.connector.transfers_running}")

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self.engine.on_failure(callback)

    def shutdown(self) -> None:
        self.connector.stop()
        self.engine.shutdown()


def kv_port(engine_args: EngineArgs, http_port: int) -> int:
    """Gives the KV agent's port: --kv-transfer-port, else the HTTP port + KV_PORT_OFFSET."""
    return engine_args.kv_transfer_port or http_port + KV_PORT_OFFSET


def attach_role(engine: LLMEngine, host: str, http_port: int) -> ServedEngine:
    """Gives the engine to serve: itself for role `both`, else a RoleEngine with its KV agent."""
    role = engine.engine_args.role
    if role == "both":
        return engine
    from kvpilot.engine.kv_transfer.tcp import TcpConnector

    # The KV agent's threads need the GIL after each socket call; the engine thread runs
    # Python almost without pause. CPython makes a waiting thread wait up to the switch
    # interval (5 ms by default) for the GIL, per block received: at 1 ms a pull is not
    # paced by the engine's host work (and the engine gives the GIL up sooner).
    sys.setswitchinterval(min(sys.getswitchinterval(), ROLE_SWITCH_INTERVAL_S))
    lease_seconds = float(os.environ.get(LEASE_SECONDS_ENV, DEFAULT_LEASE_SECONDS))
    kv_key, port = engine.fleet_secret.kv_key, kv_port(engine.engine_args, http_port)
    if role == "decode":
        store = _landing_store(engine)
        decode = TcpConnector(store, host, port, lease_seconds, kv_key=kv_key,
                              nixl=_nixl_agent(engine, host, port, landing=store.host.data))
        decode.start()
        transport, lock, port = decode, nullcontext(), decode.port
    else:
        from kvpilot.engine.kv_transfer.engine_store import EngineBlockStore

        store = EngineBlockStore.of_engine(engine)
        prefill = TcpConnector(store, host, port, lease_seconds, kv_key=kv_key,
                               nixl=_nixl_agent(engine, host, port, store.caches))
        prefill.start()
        transport, lock, port = prefill, store.lock, prefill.port
    log.info("role %s: KV agent on %s:%d (transport %s)", role, host, port,
             transport.transport)
    return RoleEngine(engine, transport, role, lock)


def _nixl_agent(engine: LLMEngine, host: str, port: int,
                caches: list[torch.Tensor] | None = None,
                landing: torch.Tensor | None = None) -> NixlAgent | None:
    """Gives a NIXL agent (with a prefill engine's `caches`, or a decode engine's `landing`
    rows, registered at start-up) under --kv-transport nixl when nixl works here, else None
    (TCP)."""
    if engine.engine_args.kv_transport != "nixl":
        return None
    from kvpilot.engine.kv_transfer.nixl_agent import make_agent

    # unique per process: a restarted peer's metadata must not be taken for the old one's
    return make_agent(f"kvpilot-{engine.engine_args.role}-{host}:{port}-{os.getpid()}-"
                      f"{time.monotonic_ns()}", caches, landing)


def _landing_store(engine: LLMEngine) -> LandingStore:
    """Gives the store a decode engine's agent pulls into: its host tier's pool."""
    from kvpilot.engine.kv_connector.landing_store import LandingStore

    connector = engine.connector
    if connector is None:  # make_host_tier gives a decode engine one
        raise AssertionError("a decode engine has a host tier to land pulled KV in")
    cuda = connector.device.type == "cuda"
    store = LandingStore(connector.pool, engine.kv.pool, pin_memory=cuda)
    if cuda:
        store.receive_buffers.fill()  # pinned now, not while pulls run beside steps
    return store
