"""Tiny engines in prefill and decode roles with --kv-transport nixl (DRAM registrations,
UCX, on CPU): pulled KV moves by NIXL READs and gives the aggregated engine's greedy
tokens; a peer without NIXL, an engine where nixl does not import, and a failed READ
all end in a TCP pull with the same tokens; /metrics names the transport."""

from __future__ import annotations

import asyncio

import pytest
from helpers.engine_run import run

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.engine.kv_transfer import nixl_agent, nixl_region
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.operator.local.supervisor import free_port


def _nixl_missing() -> str:
    """Gives why nixl cannot be used here, or '' when it can."""
    try:
        nixl_agent.nixl_api()
    except nixl_agent.NixlUnavailable as exc:
        return str(exc)
    return ""


needs_nixl = pytest.mark.skipif(bool(_nixl_missing()), reason=_nixl_missing())

BLOCK = 16
NUM_BLOCKS = 64
FIRST = SamplingParams(temperature=0, max_tokens=1)


def aggregated():
    return LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS,
                                                 block_size=BLOCK, dtype="float32"))


def make_engine(role: str, transport: str = "nixl"):
    # float32: greedy tokens of a random tiny model are compared exactly
    args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, role=role,
                      kv_transfer_port=free_port(), dtype="float32", kv_transport=transport)
    return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)


def agent(engine) -> tuple[str, int]:
    return ("127.0.0.1", engine.connector.port)


@pytest.fixture(scope="module")
def engines():
    both, prefill, decode = aggregated(), make_engine("prefill"), make_engine("decode")
    yield both, prefill, decode
    prefill.shutdown()
    decode.shutdown()


def handoff(both, prefill, decode, name: str, prompt: list[int], recomputed: int = 1) -> dict:
    """Prefills on `prefill`, pulls into `decode`, decodes there; asserts the aggregated
    tokens, that the decode engine computed `recomputed` prompt tokens (1: only the last,
    the pulled blocks passed their checksums and were used), and gives the pull's DONE
    message."""
    expected, _ = run(both, f"agg-{name}", prompt)
    assert run(prefill, f"pre-{name}", prompt, FIRST)[0] == expected[:1]
    done = asyncio.run(request_pull(agent(decode), agent(prefill), f"pre-{name}", timeout=20))
    computed_before = decode.engine.prompt_tokens
    assert run(decode, f"dec-{name}", prompt)[0] == expected
    assert decode.engine.prompt_tokens - computed_before == recomputed
    return done


@needs_nixl
def test_nixl_pull_equals_aggregated(engines):
    both, prefill, decode = engines
    assert (prefill.connector.transport, decode.connector.transport) == ("nixl", "nixl")
    before = dict(decode.connector.pulls)
    done = handoff(both, prefill, decode, "nixl", [*range(3, 3 + 5 * BLOCK), *range(200, 210)])
    # 5 full blocks and the cached tail, read by NIXL, not sent as BLOCK frames
    assert (done["transport"], done["imported"], done["skipped"]) == ("nixl", 6, 0)
    assert decode.connector.pulls["nixl"] == before["nixl"] + 1
    assert len(prefill.connector.leases) == 0  # RELEASE came after the READs


def _recording(monkeypatch, agent, name: str) -> list[int]:
    """Wraps `agent.<name>` (read or read_rows) to count its calls; gives the counter."""
    calls, method = [], getattr(agent, name)

    def recorded(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    monkeypatch.setattr(agent, name, recorded)
    return calls


@needs_nixl
def test_a_pull_reads_the_packed_send_region_not_the_cache_pieces(engines, monkeypatch):
    both, prefill, decode = engines
    region = prefill.connector.nixl.agent.region
    assert region is not None and region.num_rows == NUM_BLOCKS
    rows = _recording(monkeypatch, decode.connector.nixl.agent, "read_rows")
    pieces = _recording(monkeypatch, decode.connector.nixl.agent, "read")
    done = handoff(both, prefill, decode, "region", [*range(300, 300 + 4 * BLOCK), 7])
    assert (done["transport"], done["imported"]) == ("nixl", 5)
    assert (len(rows), len(pieces)) == (1, 0)
    assert region.free_rows == NUM_BLOCKS  # given back at RELEASE


@needs_nixl
def test_a_full_send_region_reads_the_cache_pieces_instead(engines, monkeypatch):
    both, prefill, decode = engines
    region = prefill.connector.nixl.agent.region
    monkeypatch.setattr(nixl_region, "ROOM_WAIT_S", 0.05)
    first = region.take(region.num_rows)  # another pull holds every row
    assert first == 0
    try:
        rows = _recording(monkeypatch, decode.connector.nixl.agent, "read_rows")
        pieces = _recording(monkeypatch, decode.connector.nixl.agent, "read")
        done = handoff(both, prefill, decode, "full", [*range(400, 400 + 3 * BLOCK), 8])
        assert (done["transport"], done["imported"]) == ("nixl", 4)
        assert (len(rows), len(pieces)) == (0, 1)
    finally:
        region.give(0, region.num_rows)


@needs_nixl
def test_metrics_name_the_transport(engines):
    _, _, decode = engines
    metrics = ServerMetrics("tiny")
    metrics.set_stats(decode.get_stats())
    text = metrics.render().decode()
    assert 'kvpilot_kv_transport_info{model_name="tiny",transport="nixl"} 1.0' in text
    assert 'kvpilot_kv_pulls_total{model_name="tiny",transport="nixl"}' in text


@needs_nixl
def test_failed_read_falls_back_to_tcp(engines, monkeypatch):
    both, prefill, decode = engines

    def broken_read(*args, **kwargs):
        raise nixl_agent.NixlError("injected: the agents cannot reach each other")

    monkeypatch.setattr(decode.connector.nixl.agent, "_read", broken_read)
    monkeypatch.setattr(decode.connector.nixl, "failed", {})
    done = handoff(both, prefill, decode, "broken", [*range(700, 700 + 3 * BLOCK), 5])
    assert done["transport"] == "tcp"  # the second attempt moved the blocks by BLOCK frames
    assert f"127.0.0.1:{prefill.connector.port}" in decode.connector.nixl.failed


@needs_nixl
def test_peer_without_nixl_is_pulled_over_tcp(engines):
    both, _, decode = engines
    prefill_tcp = make_engine("prefill", transport="tcp")
    try:
        assert prefill_tcp.connector.transport == "tcp"
        done = handoff(both, prefill_tcp, decode, "tcp-peer", [*range(800, 800 + 2 * BLOCK), 9])
        assert done["transport"] == "tcp"
    finally:
        prefill_tcp.shutdown()


def test_nixl_import_failure_falls_back_to_tcp(monkeypatch):
    """Runs with or without nixl installed: --kv-transport nixl where it does not import."""

    def missing():
        raise nixl_agent.NixlUnavailable("injected: No module named 'nixl'")

    monkeypatch.setattr(nixl_agent, "nixl_api", missing)
    prefill, decode = make_engine("prefill"), make_engine("decode")
    try:
        for engine in (prefill, decode):
            assert engine.connector.transport == "tcp" and engine.connector.nixl is None
            assert engine.get_stats().kv_transport == "tcp"
        done = handoff(aggregated(), prefill, decode, "no-nixl",
                       [*range(900, 900 + 2 * BLOCK), 4])
        assert done["transport"] == "tcp"
    finally:
        prefill.shutdown()
        decode.shutdown()


@needs_nixl
def test_block_corrupted_in_flight_is_recomputed_not_read(engines, monkeypatch):
    both, prefill, decode = engines
    read = decode.connector.nixl.agent.read_rows

    def corrupting_read(peer, layout, region_rows, rows, timeout, at=None):
        read(peer, layout, region_rows, rows, timeout, at)
        rows[at[1], :64] ^= 0x5A  # the second block's host-tier row, as if overwritten mid-READ

    monkeypatch.setattr(decode.connector.nixl.agent, "read_rows", corrupting_read)
    failed_before = decode.get_stats().kv_offload_failed_blocks
    prompt = [*range(600, 600 + 3 * BLOCK), 6]
    # block 1 fails its checksum at load: the sequence goes back to its GPU hit (none) and
    # recomputes the whole prompt, with the aggregated engine's tokens
    done = handoff(both, prefill, decode, "corrupt", prompt, recomputed=len(prompt))
    assert done["transport"] == "nixl"
    assert decode.get_stats().kv_offload_failed_blocks > failed_before


@pytest.mark.gpu
@needs_nixl
def test_gpu_nixl_pull_from_vram_equals_aggregated():
    """The prefill engine registers its CUDA caches (VRAM); the decode engine READs them into
    its pinned receive buffers, checks them at load, and decodes the aggregated tokens."""

    def cuda_engine(role: str):
        args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          role=role, kv_transfer_port=free_port(), dtype="float32",
                          device="cuda", kv_transport="nixl")
        engine = LLMEngine.from_engine_args(args)
        return engine if role == "both" else attach_role(engine, "127.0.0.1", 0)

    both, prefill, decode = cuda_engine("both"), cuda_engine("prefill"), cuda_engine("decode")
    try:
        assert prefill.connector.nixl.agent.layout.mem == "VRAM"
        done = handoff(both, prefill, decode, "gpu", [*range(3, 3 + 5 * BLOCK), 7])
        assert (done["transport"], done["imported"]) == ("nixl", 6)
    finally:
        prefill.shutdown()
        decode.shutdown()


@needs_nixl
@pytest.mark.parametrize(("role", "registration"), [
    ("prefill", "register_caches"),  # its caches and send region
    ("decode", "register_rows"),  # its landing rows, at start-up: not as a failed first pull
])
def test_memory_nixl_cannot_register_leaves_the_engine_on_tcp(monkeypatch, role, registration):
    def refuse(self, memory):
        raise RuntimeError("injected: UCX has no transport for this memory")

    monkeypatch.setattr(nixl_agent.NixlAgent, registration, refuse)
    engine = make_engine(role)
    try:
        assert engine.connector.transport == "tcp" and engine.connector.nixl is None
    finally:
        engine.shutdown()
