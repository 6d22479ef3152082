"""Real tiny engines in prefill and decode roles: pulled KV gives the aggregated engine's
greedy tokens, the decode side skips blocks it holds, and leases never leak blocks."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from disagg_import import import_data
from helpers.engine_run import run

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import LEASE_SECONDS_ENV, attach_role
from kvpilot.operator.local.supervisor import free_port

BLOCK = 16
NUM_BLOCKS = 64
SYSTEM = list(range(3, 3 + 4 * BLOCK))  # 4 blocks every prompt below starts with


def make_engine(role: str):
    # float32 on any device: greedy tokens of a random tiny model are compared exactly, and in
    # bf16 a different batch shape (prefix hit vs recompute) may flip a near-tie argmax
    args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, role=role,
                      kv_transfer_port=free_port(), dtype="float32")
    return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)




@pytest.fixture(scope="module")
def engines():
    os.environ[LEASE_SECONDS_ENV] = "0.5"
    try:
        both, prefill, decode = make_engine("both"), make_engine("prefill"), make_engine("decode")
    finally:
        del os.environ[LEASE_SECONDS_ENV]
    yield both, prefill, decode
    prefill.shutdown()
    decode.shutdown()


def agent(engine) -> tuple[str, int]:
    return ("127.0.0.1", engine.connector.port)


def wait_for_free_blocks(engine, expected: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    pool = engine.engine.kv.pool  # the RoleEngine's LLMEngine
    while pool.num_free_blocks != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool.num_free_blocks


@pytest.mark.parametrize(("name", "prompt", "decode_warmup", "imported", "skipped"), [
    # a fresh prompt: all 5 full blocks move, and the partial 6th (the prefill engine cached it
    # under its tail hash): the decode engine computes only the last prompt token
    ("fresh", [*SYSTEM, *range(200, 230)], None, 6, 0),
    # the decode side served another prompt with the same system part: 4 blocks stay home
    ("shared", [*SYSTEM, *range(300, 330)], [*SYSTEM, *range(400, 420)], 2, 4),
])
def test_disaggregated_equals_aggregated(engines, name, prompt, decode_warmup, imported,
                                         skipped):
    both, prefill, decode = engines
    expected, _ = run(both, f"agg-{name}", prompt)
    if decode_warmup:
        run(decode, f"warm-{name}", decode_warmup)
    first, _ = run(prefill, f"pre-{name}", prompt, SamplingParams(temperature=0, max_tokens=1))
    assert first == expected[:1]
    done = asyncio.run(request_pull(agent(decode), agent(prefill), f"pre-{name}", timeout=10))
    assert (done["imported"], done["skipped"]) == (imported, skipped)
    computed_before = decode.engine.prompt_tokens
    tokens, final = run(decode, f"dec-{name}", prompt)
    assert tokens == expected
    assert final.num_cached_tokens == len(prompt) - 1
    assert decode.engine.prompt_tokens - computed_before == 1  # a one-token row: a decode-shaped step
    # released on pull: the prefill side owns nothing any more
    assert wait_for_free_blocks(prefill, NUM_BLOCKS, 2) == NUM_BLOCKS


def test_corrupt_kv_changes_the_answer(engines):
    # The equality above is only meaningful if imported KV is actually used.
    both, _, decode = engines
    prompt = [*range(500, 500 + 3 * BLOCK), 7, 8]
    expected, _ = run(both, "agg-corrupt", prompt)
    store = decode.connector.store
    hashes = hash_prompt_blocks(prompt, BLOCK)
    noise = bytes(range(256)) * (store.block_bytes // 256)
    assert import_data(store, hashes, [noise] * len(hashes)) == 3
    assert run(decode, "dec-corrupt", prompt)[0] != expected


def test_unpulled_lease_expires_without_leaking(engines):
    _, prefill, _ = engines
    run(prefill, "pre-orphan", [*range(600, 600 + 5 * BLOCK)],
        SamplingParams(temperature=0, max_tokens=1))
    assert len(prefill.connector.leases) == 1
    assert prefill.engine.kv.pool.num_free_blocks == NUM_BLOCKS - 5  # pinned for the decode side
    assert wait_for_free_blocks(prefill, NUM_BLOCKS, 3) == NUM_BLOCKS
    assert len(prefill.connector.leases) == 0


@pytest.mark.gpu
def test_gpu_blocks_round_trip_bit_exact():
    import torch

    from kvpilot.engine.kv_transfer.engine_store import EngineBlockStore

    def cuda_engine():
        args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                          device="cuda", dtype="bfloat16")
        return LLMEngine.from_engine_args(args)

    source, target = cuda_engine(), cuda_engine()
    prompt = [*SYSTEM, 5, 6]
    run(source, "gpu-src", prompt, SamplingParams(temperature=0, max_tokens=1))
    src, dst = EngineBlockStore.of_engine(source), EngineBlockStore.of_engine(target)
    hashes, pinned = src.pin(prompt)
    assert len(hashes) == 4
    read = src.read(pinned, hashes)
    assert import_data(dst, hashes, read.wait()) == 4
    read.release()
    torch.cuda.synchronize()
    for block_hash in hashes:
        a = source.kv.pool.lookup(block_hash).block_id
        b = target.kv.pool.lookup(block_hash).block_id
        for src_cache, dst_cache in zip(source.runner.kv_caches, target.runner.kv_caches,
                                        strict=True):
            assert torch.equal(src_cache[:, a], dst_cache[:, b])
    src.unpin(pinned)


@pytest.mark.gpu
def test_gpu_lease_read_while_steps_run_is_bit_exact():
    """A read of a lease waits neither for the engine lock nor for the engine's stream: the
    blocks were written by steps that ran before the lease opened. Read while another
    request's step is in flight (async scheduling), compare after a full synchronize."""
    import torch

    args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
                      role="prefill", kv_transfer_port=free_port(), device="cuda",
                      dtype="bfloat16")
    engine = attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)
    try:
        engine.add_request("busy", list(range(500, 540)),
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        prompt = [*SYSTEM, *range(200, 230)]  # 5 full blocks and a tail
        engine.add_request("target", prompt, SamplingParams(temperature=0, max_tokens=1))
        datas = None
        for _ in range(50):
            if any(o.request_id == "target" and o.finished for o in engine.step()):
                lease = engine.connector.leases.get("target", time.monotonic())
                datas = [bytes(d) for d in engine.connector._read(lease, lease.hashes).wait()]
                break
        assert datas is not None and len(lease.hashes) == 6
        assert engine.engine.has_unfinished_requests()  # the busy request kept stepping
        torch.cuda.synchronize()
        store = engine.connector.store
        for block_hash, data in zip(lease.hashes, datas, strict=True):
            block_id = store.pool.lookup(block_hash).block_id
            expected = torch.stack([cache[:, block_id] for cache in store.caches])
            assert data == expected.view(torch.int16).cpu().numpy().tobytes()
    finally:
        engine.shutdown()
