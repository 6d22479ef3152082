"""Faults around a decode engine's landing pool: a prefill peer killed mid-transfer leaves the
checked groups in host memory and the request computes the rest, with the aggregated
engine's tokens; a decode engine with no prefill peer at all recomputes everything."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers.engine_run import GREEDY, run
from kv_tier_helpers import BLOCK, make_engine

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.kv_protocol import ProtocolError, send_buffers
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.engine.kv_transfer import tcp
from kvpilot.operator.local.supervisor import free_port

PROMPT = [*range(40, 40 + 5 * BLOCK), 7, 8, 9]  # 5 full blocks and a 3-token tail


def role_engine(role: str):
    args = EngineArgs(model="tiny-llama", num_kv_blocks=64, block_size=BLOCK, role=role,
                      kv_transfer_port=free_port(), dtype="float32")
    return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)


@pytest.fixture
def pair():
    prefill, decode = role_engine("prefill"), role_engine("decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_prefill_killed_mid_transfer_ends_in_partial_load_and_recompute(pair, monkeypatch):
    prefill, decode = pair
    expected = run(make_engine(), "agg", PROMPT)[0]
    prefill.add_request("pre", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    for _ in range(50):
        if not prefill.has_unfinished_requests():
            break
        prefill.step()
    prefill.connector.store.read_chunk_blocks = 2  # the prefill side sends 2 blocks a chunk
    decode.connector.store.receive_chunk_blocks = 2  # the decode side imports 2 at a time
    sends = []

    def dies_after_one_chunk(sock: socket.socket, buffers) -> None:
        sends.append(len(buffers))
        if len(sends) > 1:  # the prefill engine's agent dies mid-lease, every attempt
            sock.shutdown(socket.SHUT_RDWR)
            raise OSError("killed")
        send_buffers(sock, buffers)

    monkeypatch.setattr(tcp, "send_buffers", dies_after_one_chunk)
    with pytest.raises(ProtocolError, match="failed"):
        asyncio.run(request_pull(("127.0.0.1", decode.connector.port),
                                 ("127.0.0.1", prefill.connector.port), "pre", timeout=10))
    host = decode.engine.connector.pool
    hashes = hash_prompt_blocks(PROMPT, BLOCK)
    assert host.num_cached_prefix(hashes) == 2  # the one checked group landed, no more
    before = decode.get_stats()
    tokens, final = run(decode, "dec", PROMPT)
    assert tokens == expected
    assert final.num_cached_tokens == 2 * BLOCK
    assert decode.get_stats().prompt_tokens - before.prompt_tokens == len(PROMPT) - 2 * BLOCK


def test_decode_without_its_prefill_peer_recomputes(pair):
    prefill, decode = pair
    expected = run(make_engine(), "agg", PROMPT)[0]
    address = ("127.0.0.1", prefill.connector.port)
    prefill.shutdown()  # the peer is gone before the router's pull
    with pytest.raises(ProtocolError, match="failed"):
        asyncio.run(request_pull(("127.0.0.1", decode.connector.port), address, "gone",
                                 timeout=3))
    tokens, final = run(decode, "dec", PROMPT)
    assert tokens == expected and final.num_cached_tokens == 0
    assert GREEDY.max_tokens == len(tokens)
