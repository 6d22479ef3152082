"""Async scheduling (`--async-scheduling on`) gives what synchronous steps give.

Under async scheduling a step is launched before the previous one is read back:
the scheduler sees a placeholder for each token in flight and the runner patches
it on the device. These tests force it on (CUDA's default) on CPU, where the
same code runs, and compare every request with a synchronous engine's.
"""

from __future__ import annotations

import random

import pytest
from core_helpers import Outputs, run_engine

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.engine_loop.flights import PLACEHOLDER, needs_host_sampling
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

NUM_BLOCKS = 24


def make_engine(mode: str, **flags) -> LLMEngine:
    args = dict(model="tiny-llama", device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=4,
                max_num_batched_tokens=32, max_num_seqs=6, async_scheduling=mode)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **flags}))


def run_workload(engine: LLMEngine, seed: int) -> dict[str, tuple]:
    """Feeds 14 mixed requests over time (shared prefixes, stops, seeds, one with a penalty)."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, 500) for _ in range(12)]
    pending = list(range(14))
    outputs = Outputs()
    done: dict[str, tuple] = {}
    for _ in range(2000):
        if not pending and not engine.has_unfinished_requests():
            break
        if pending and rng.random() < 0.5:
            i = pending.pop(0)
            prompt = (shared if i % 2 else []) + [rng.randrange(5, 500)
                                                  for _ in range(rng.randrange(1, 20))]
            engine.add_request(str(i), prompt, SamplingParams(
                max_tokens=rng.randrange(1, 24), temperature=0 if i % 3 else 0.8, seed=i,
                ignore_eos=i % 2 == 0, stop=["e"] if i % 5 == 1 else None,
                presence_penalty=0.5 if i == 7 else 0.0))
        for delta in engine.step():
            assert PLACEHOLDER not in delta.completions[0].token_ids
            out = outputs.add(delta)
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason)
    assert not engine.has_unfinished_requests()
    return done


@pytest.mark.parametrize("seed", range(6))
def test_async_outputs_equal_sync_outputs(seed):
    sync, overlap = make_engine("off"), make_engine("on")
    assert not sync.async_scheduling and overlap.async_scheduling
    assert run_workload(overlap, seed) == run_workload(sync, seed)
    for engine in (sync, overlap):
        assert engine.kv.pool.num_free_blocks == NUM_BLOCKS  # nothing leaked
    # the pool is small enough that sequences with a token in flight get preempted
    assert overlap.scheduler.num_preemptions > 0


def test_placeholder_never_reaches_the_model():
    engine = make_engine("on")
    seen: list[int] = []
    model = engine.runner.model
    forward = model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append(int(input_ids.min()))
        return forward(input_ids, *args, **kwargs)

    model.forward = spy
    run_workload(engine, 3)
    assert seen and min(seen) >= 0


def test_async_step_returns_the_previous_steps_tokens():
    engine = make_engine("on")
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the first step's token is still "in flight"
    tokens = []
    for finished in (False, False, True):  # each step gives its one new token (a delta)
        (delta,) = engine.step()
        assert delta.finished is finished and len(delta.completions[0].token_ids) == 1
        tokens += delta.completions[0].token_ids
    assert not engine.has_unfinished_requests()
    assert len(tokens) == 3 and PLACEHOLDER not in tokens


def test_length_limited_requests_run_no_extra_forward():
    """A sequence whose in-flight token is its last is not scheduled again."""
    counts = {}
    for mode in ("off", "on"):
        engine = make_engine(mode)
        calls = []
        execute = engine.runner.execute
        engine.runner.execute = lambda *a, _e=execute, _c=calls: _c.append(1) or _e(*a)
        for i in range(4):
            engine.add_request(str(i), [5 + i] * (3 + i), SamplingParams(max_tokens=5 + i,
                                                                        ignore_eos=True))
        run_engine(engine)
        counts[mode] = len(calls)
    assert counts["on"] == counts["off"]


def test_abort_while_a_token_is_in_flight():
    engine = make_engine("on")
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.flights.inflight is not None
    engine.abort_request(["a"])
    out = engine.step()
    assert out[0].finished and out[0].completions[0].finish_reason == "abort"
    assert PLACEHOLDER not in out[0].completions[0].token_ids
    for _ in range(10):
        if not engine.has_unfinished_requests():
            break
        assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == NUM_BLOCKS


def test_host_sampling_requests_drain_the_flight():
    """A request with logprobs arriving mid-run gets correct logprobs (a synchronous step)."""
    outs = {}
    for mode in ("off", "on"):
        engine, seen = make_engine(mode), Outputs()
        engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        for _ in range(2):
            for delta in engine.step():
                seen.add(delta)
        engine.add_request("lp", [9, 10], SamplingParams(max_tokens=4, logprobs=2,
                                                         ignore_eos=True))
        outs[mode] = {rid: o.outputs[0] for rid, o in run_engine(engine, outputs=seen).items()}
    assert outs["on"]["plain"].token_ids == outs["off"]["plain"].token_ids
    on, off = outs["on"]["lp"], outs["off"]["lp"]
    assert on.token_ids == off.token_ids
    assert [sorted(d) for d in on.logprobs] == [sorted(d) for d in off.logprobs]
    for a, b in zip(on.logprobs, off.logprobs, strict=True):
        for tid in a:
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-5)


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), False), (SamplingParams(temperature=0.8, top_p=0.9, seed=1), False),
    (SamplingParams(stop=["x"]), False), (SamplingParams(logprobs=0), True),
    (SamplingParams(n=2), True), (SamplingParams(repetition_penalty=1.1), True),
    (SamplingParams(min_tokens=2), True), (SamplingParams(prompt_logprobs=1), True),
    (SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), False),
])
def test_needs_host_sampling(params, expected):
    assert needs_host_sampling(params) is expected


def test_async_scheduling_flag_defaults_to_cuda_only():
    assert make_engine("auto").async_scheduling is False  # device cpu
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="tiny-llama", async_scheduling="yes")


def run_fixed_batch(engine: LLMEngine) -> dict[str, list[int]]:
    """Runs 10 requests added up front, length-limited only: every step's batch is the same in
    both modes (no stop seen late, no admission waiting for a read-back), so even GPU numerics,
    which depend on the batch shape, must agree bit for bit."""
    rng = random.Random(5)
    for i in range(10):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randrange(1, 40))]
        engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=rng.randrange(1, 30), temperature=0 if i % 2 else 0.8, seed=i,
            ignore_eos=True))
    outputs, done = Outputs(), {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert len(done) == 10
    return done


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fixed_batch_outputs_equal_sync_outputs(device):
    """On CUDA this covers graphs, the pinned read-back and the device-side patches."""
    flags = dict(device=device, max_num_seqs=16, num_kv_blocks=256)
    if device == "cuda":
        flags.update(dtype="float32", gpu_memory_utilization=0.3)
    sync, overlap = make_engine("off", **flags), make_engine("on", **flags)
    assert overlap.async_scheduling
    if device == "cuda":
        assert overlap.runner.decode_graphs is not None
    assert run_fixed_batch(overlap) == run_fixed_batch(sync)
    assert overlap.kv.pool.num_free_blocks == overlap.kv.num_blocks


@pytest.mark.parametrize("mode", ["on", "off"])
def test_step_timing_names_the_phases_and_the_batch(mode):
    """The slow-iteration log's view of a step: each phase's time and what was batched."""
    engine = make_engine(mode)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    timing = engine.step_timing()
    phases = ["schedule", "prepare", "forward", "sample", "resolve", "advance"] \
        if mode == "on" else ["schedule", "prepare", "forward", "sample"]
    assert timing.startswith("GPU wait 0.0 ms [")
    assert [p.split()[0] for p in timing[timing.index("[") + 1:timing.index(" ms;")].split(", ")
            ] == phases
    assert timing.endswith("; 1 seqs, 5 tokens, eager, 0 block copies]")  # CPU: no graphs
