"""The KV agents' handshake (`contracts/kv_auth.py`): the issue's forged PULL frame is refused
and imports nothing; agents of another fleet are refused both ways; a fleet sharing one
secret still pulls, with salted hashes, and the decode engine uses what it pulled."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from disagg_fake_store import FakeStore

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.kv_auth import accept_peer
from kvpilot.engine.contracts.kv_client import request_pull, request_stats
from kvpilot.engine.contracts.kv_protocol import (
    Frame,
    ProtocolError,
    encode,
    encode_block,
    expect,
    read_frame,
)
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.engine.kv_transfer.tcp import TcpConnector
from kvpilot.operator.local.supervisor import free_port

BLOCK = 16
VICTIM_PROMPT = [*range(40, 40 + 5 * BLOCK), 9]  # 5 full blocks a later request will send
SECRET = FleetSecret(bytes(range(32)))
OTHER = FleetSecret(bytes(range(1, 33)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A prefill and a decode engine sharing SECRET (from a --fleet-secret-file)."""
    path = tmp_path_factory.mktemp("fleet") / "secret"
    path.write_text(SECRET.secret.hex() + "\n")
    engines = [attach_role(LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", num_kv_blocks=64, block_size=BLOCK, role=role,
        kv_transfer_port=free_port(), fleet_secret_file=str(path))), "127.0.0.1", 0)
        for role in ("prefill", "decode")]
    yield engines
    for engine in engines:
        engine.shutdown()


async def forged_prefill_agent(block_bytes: int, contacted: list[str]) -> asyncio.Server:
    """The attacker's agent: a lease of the victim prompt's (unsalted) hashes, blocks of its
    choosing, answered to whoever asks."""
    hashes = hash_prompt_blocks(VICTIM_PROMPT, BLOCK)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        contacted.append("connected")
        with contextlib.suppress(ProtocolError, ConnectionError):
            await read_frame(reader)  # FETCH
            writer.write(encode(Frame.LEASE, {"hashes": hashes, "block_bytes": block_bytes}))
            _, want = await expect(reader, Frame.WANT)
            for block_hash in want["hashes"]:
                writer.write(b"".join(bytes(part) for part in
                                      encode_block(block_hash, b"\x07" * block_bytes)))
            writer.write(encode(Frame.END))
            await expect(reader, Frame.RELEASE)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_a_forged_pull_frame_is_refused_and_imports_nothing(fleet):
    _, decode = fleet
    store = decode.connector.store
    contacted: list[str] = []
    attacker = await forged_prefill_agent(store.block_bytes, contacted)
    owned_before, free_before = store.owned_blocks(), store.pool.num_free_blocks
    reader, writer = await asyncio.open_connection("127.0.0.1", decode.connector.port)
    port = attacker.sockets[0].getsockname()[1]
    writer.write(encode(Frame.PULL, {"remote": f"127.0.0.1:{port}", "lease_id": "x",
                                     "timeout": 5}))
    await writer.drain()
    frame, payload = await asyncio.wait_for(read_frame(reader), 10)
    writer.close()
    attacker.close()
    # before the handshake: DONE {"imported": 5, ...}
    assert frame is Frame.ERROR, payload
    assert b"authentication failed" in payload
    assert contacted == []  # the decode agent never pulled
    hashes = hash_prompt_blocks(VICTIM_PROMPT, BLOCK)
    assert store.num_cached_prefix(hashes) == 0
    assert (store.owned_blocks(), store.pool.num_free_blocks) == (owned_before, free_before)


@pytest.mark.parametrize("guess", [FleetSecret(), OTHER])
async def test_a_pull_proved_with_another_secret_is_refused(fleet, guess):
    _, decode = fleet
    with pytest.raises(ProtocolError, match=r"failed authentication|authentication failed"):
        await request_pull(("127.0.0.1", decode.connector.port), ("127.0.0.1", 1), "x",
                           timeout=5, key=guess.kv_key)


async def test_a_decode_agent_refuses_a_prefill_agent_of_another_fleet():
    """Mutual: the router's PULL is genuine, but the agent it names cannot prove the secret."""
    decode = TcpConnector(FakeStore(), "127.0.0.1", 0, kv_key=SECRET.kv_key)
    decode.start()
    impostor_tried: list[str] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ProtocolError, ConnectionError):
            await accept_peer(reader, writer, OTHER.kv_key)
            impostor_tried.append("authenticated")
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        remote = ("127.0.0.1", server.sockets[0].getsockname()[1])
        with pytest.raises(ProtocolError, match="failed authentication"):
            await request_pull(("127.0.0.1", decode.port), remote, "x", timeout=5,
                               key=SECRET.kv_key)
        assert impostor_tried == [] and decode.store.blocks == {}
    finally:
        server.close()
        decode.stop()


async def test_an_unauthenticated_peer_cannot_make_the_agent_buffer_a_large_frame():
    agent = TcpConnector(FakeStore(), "127.0.0.1", 0, kv_key=SECRET.kv_key)
    agent.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
        writer.write(encode(Frame.AUTH, {"nonce": "00" * 16, "pad": "x" * 10_000}))
        frame, payload = await asyncio.wait_for(read_frame(reader), 10)
        assert frame is Frame.ERROR and b"authentication failed" in payload
        writer.close()
        # and the agent still serves its own fleet
        stats = await request_stats(("127.0.0.1", agent.port), key=SECRET.kv_key)
        assert stats["leases"] == 0
    finally:
        agent.stop()


def run(engine, request_id: str, prompt: list[int], max_tokens: int = 4):
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
    final = None
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                final = output
    assert final is not None
    return final


async def test_one_secret_pulls_salted_blocks_the_decode_engine_uses(fleet):
    prefill, decode = fleet
    prompt = [*range(300, 300 + 3 * BLOCK), 5]
    run(prefill, "pre-salted", prompt, max_tokens=1)
    salted = hash_prompt_blocks(prompt, BLOCK, salt=SECRET.block_hash_salt)
    assert prefill.connector.store.num_cached_prefix(salted) == 3  # the engine salts its cache
    assert prefill.connector.store.num_cached_prefix(hash_prompt_blocks(prompt, BLOCK)) == 0
    done = await request_pull(("127.0.0.1", decode.connector.port),
                              ("127.0.0.1", prefill.connector.port), "pre-salted", timeout=10,
                              key=SECRET.kv_key)
    assert done["imported"] == 4  # 3 full blocks and the tail
    assert run(decode, "dec-salted", prompt).num_cached_tokens == len(prompt) - 1
