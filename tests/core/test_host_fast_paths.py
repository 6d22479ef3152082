"""The engine's host fast paths give what the plain code they replaced gives.

Batch building (one packed buffer, read back as views), the KV manager's cached block-id arrays and
allocate_slots' decode shortcut, and the sampler's uniform-temperature path are
each checked against a straightforward reference written out here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from core_helpers import make_request, make_scheduler, run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.worker.sampler import Sampler, SamplingRow
from kvpilot.engine.worker.step_batch import BatchEntry, unpack_step


def reference_batch(entries: list[BatchEntry], bs: int) -> dict[str, list]:
    """Gives the flat batch of `entries` built token by token (the metadata contract)."""
    ids, positions, slots, qsl, lens, rows = [], [], [], [0], [], []
    width = max(len(e.block_ids) for e in entries)
    tables = [list(e.block_ids) + [-1] * (width - len(e.block_ids)) for e in entries]
    for e in entries:
        for j, token in enumerate(e.token_ids):
            pos = e.start_pos + j
            ids.append(token)
            positions.append(pos)
            slots.append(int(e.block_ids[pos // bs]) * bs + pos % bs)
        first = qsl[-1]
        qsl.append(first + len(e.token_ids))
        lens.append(e.start_pos + len(e.token_ids))
        rows += {"last": [qsl[-1] - 1], "all": list(range(first, qsl[-1])), "none": []}[e.logits]
    return {"ids": ids, "positions": positions, "slot_mapping": slots, "query_start_loc": qsl,
            "seq_lens": lens, "block_tables": tables, "rows": rows}


@pytest.fixture(scope="module")
def runner():
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", device="cpu",
                                                 num_kv_blocks=64, block_size=4)).runner


# starts: half of them 0 (fresh prompts beside cached prefixes), the rest 1 to 20
entry_st = st.tuples(st.one_of(st.just(0), st.integers(1, 20)), st.integers(1, 9),
                     st.sampled_from(["last", "all", "none"]), st.booleans())


@settings(max_examples=40, deadline=None)
@given(st.lists(entry_st, min_size=1, max_size=6), st.booleans())
def test_build_batch_matches_reference(runner, specs, decode_only):
    rng = random.Random(len(specs))
    entries = []
    for start, query_len, logits, as_array in specs:
        query_len = 1 if decode_only else query_len
        num_blocks = -(-(start + query_len) // 4) + rng.randint(0, 2)  # spare blocks allowed
        blocks = rng.sample(range(64), num_blocks)
        entries.append(BatchEntry([rng.randrange(1000) for _ in range(query_len)], start,
                                  np.array(blocks, dtype=np.int64) if as_array else blocks,
                                  logits))
    entries.sort(key=lambda e: len(e.token_ids) != 1)  # decodes first, as the engine orders
    packed, buf = runner.pack(entries, [])
    step = unpack_step(packed.header, buf, packed.host)
    ids, positions, meta = step.input_ids, step.positions, step.meta
    rows = list(range(len(ids))) if step.rows is None else step.rows.tolist()
    assert len(rows) == packed.header.num_rows
    want = reference_batch(entries, 4)
    got = {"ids": ids.tolist(), "positions": positions.tolist(),
           "slot_mapping": meta.slot_mapping.tolist(),
           "query_start_loc": meta.query_start_loc.tolist(), "seq_lens": meta.seq_lens.tolist(),
           "block_tables": meta.block_tables.tolist(), "rows": rows}
    assert got == want
    assert (ids.dtype, positions.dtype, meta.slot_mapping.dtype) == (torch.long,) * 3
    assert (meta.query_start_loc.dtype, meta.seq_lens.dtype,
            meta.block_tables.dtype) == (torch.int32,) * 3
    assert meta.max_query_len == max(len(e.token_ids) for e in entries)
    assert meta.seq_lens_cpu == want["seq_lens"]
    # the prefill sequences (those after the decodes) up to the last one with a cached prefix,
    # known to a rank without the host copy too (it travels in the header)
    starts = [e.start_pos for e in entries[packed.header.num_decodes:]]
    prefixed = max((i + 1 for i, start in enumerate(starts) if start > 0), default=0)
    assert meta.prefixed_prefills == unpack_step(packed.header, buf, None).meta.prefixed_prefills \
        == prefixed
    # the decode rows' launch order: longest context first, ties in row order
    decodes = packed.header.num_decodes
    order = sorted(range(decodes), key=lambda i: -want["seq_lens"][i])
    assert (meta.decode_order.tolist() if decodes else None) == (order if decodes else
                                                                  meta.decode_order)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
       st.integers(8, 40))
def test_cached_block_ids_follow_the_tables(specs, num_blocks):
    """After every step (allocation, decode shortcut, preemption, finish) ids == tables."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4)
    for i, (prompt, max_tokens) in enumerate(specs):
        scheduler.add(make_request(f"r{i}", prompt, max_tokens=max_tokens).seqs[0])
    kv = scheduler.kv
    for _ in range(60):
        run_step(scheduler)
        for seq in scheduler.running + scheduler.waiting:
            want = [b.block_id for b in kv.block_tables.get(seq.seq_id, [])]
            assert kv.block_ids(seq) == want
            assert kv.block_id_array(seq).tolist() == want
        if not scheduler.num_unfinished:
            break


def reference_random_sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Gives the sampler's draw as written before its fast path: per-row tensors, scattered noise."""
    n = logits.shape[0]
    greedy_mask = torch.tensor([False] * n)
    greedy_ids = logits.argmax(dim=-1)
    logits = logits / torch.tensor([temperature] * n)[:, None]
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    noise[list(range(n))] = torch.empty(n, probs.shape[1]).exponential_()
    return torch.where(greedy_mask, greedy_ids, (probs / noise).argmax(dim=-1))


@pytest.mark.parametrize(("temperature", "rows"), [(0.6, 1), (0.6, 7), (1.0, 16), (1e-3, 3)])
def test_uniform_temperature_draws_as_before(temperature, rows):
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(rows))
    params = SamplingParams(temperature=temperature, max_tokens=4)
    sampling_rows = [SamplingRow(params, [1, 2], 2) for _ in range(rows)]
    torch.manual_seed(11)
    got = Sampler()(logits, sampling_rows).token_ids
    torch.manual_seed(11)
    assert got == reference_random_sample(logits, temperature).tolist()


def test_cached_block_ids_follow_copy_on_write_and_fork():
    """A fork shares the parent's blocks; the first write to the shared partial block copies it."""
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    kv = scheduler.kv
    parent = make_request("p", 6).seqs[0]  # blocks: one full, one partial (2 of 4 slots)
    assert kv.allocate_slots(parent, 6) == []
    parent.num_computed_tokens = 6
    child = parent.fork()
    kv.fork(parent, child)
    shared = kv.block_ids(parent)
    assert kv.block_id_array(child).tolist() == shared
    for seq in (parent, child):
        seq.token_ids.append(7)
    copies = kv.allocate_slots(child, 1)  # writes slot 6: the shared partial block
    assert copies == [(shared[1], kv.block_ids(child)[1])] and kv.block_ids(child)[1] != shared[1]
    assert kv.allocate_slots(parent, 1) == []  # now the parent's own block: the decode shortcut
    for seq in (parent, child):
        want = [b.block_id for b in kv.block_tables[seq.seq_id]]
        assert kv.block_ids(seq) == want and kv.block_id_array(seq).tolist() == want
    kv.free(child)
    assert kv.block_id_array(child).tolist() == []


@pytest.mark.parametrize(("device", "env", "threads"), [
    ("cuda", None, [1]),  # a GPU engine: torch's CPU ops on one thread
    ("cuda", "8", []),  # OMP_NUM_THREADS set: left as the user set it
    ("cpu", None, []),  # a CPU engine computes with torch's threads
])
def test_a_gpu_engine_runs_torch_cpu_ops_on_one_thread(monkeypatch, device, env, threads):
    from kvpilot.engine.worker import device as device_module

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    device_module.limit_host_threads(torch.device(device))
    assert calls == threads
