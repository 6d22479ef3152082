"""Short multi-token entries as single-token rows (`engine.row_layout`): the rules, and the
engine's outputs unchanged when its steps run that way.

On CUDA the layout lets a step with a prompt chunk, a prompt tail or a speculative verify
replay a decode graph; on CPU there are no graphs, so the tests force it on and check that
every kind of request gives the same tokens and logprobs as the plain engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from core_helpers import Outputs
from test_engine_mixed_load import draw_params

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.worker.row_layout import RowLayout, as_rows, extra_tokens
from kvpilot.engine.worker.startup_log import LoadReport
from kvpilot.engine.worker.step_batch import BatchEntry

BLOCKS = [3, 4]


def entry(n: int, start: int, logits: str = "last") -> BatchEntry:
    return BatchEntry(list(range(10, 10 + n)), start, BLOCKS, logits=logits, lora_slot=2)


def test_rows_ask_for_the_logits_rows_the_entry_asked_for():
    for logits, wanted in [("last", ["none", "none", "last"]), ("all", ["last"] * 3),
                           ("none", ["none"] * 3)]:
        rows = as_rows(entry(3, 12, logits))
        assert [(e.token_ids, e.start_pos, e.logits, e.lora_slot) for e in rows] == [
            ([10], 12, wanted[0], 2), ([11], 13, wanted[1], 2), ([12], 14, wanted[2], 2)]
        assert all(e.block_ids is BLOCKS for e in rows)
    # rows at 12, 13, 14 read 13 + 14 + 15 tokens; the entry reads 15
    assert extra_tokens(entry(3, 12)) == 13 + 14 + 15 - 15


def test_a_step_expands_only_when_it_then_fits_a_graph_within_the_budget():
    decode = BatchEntry([7], 9, [5], patch_row=0)
    layout = RowLayout(max_rows=9, max_extra_tokens=extra_tokens(entry(4, 12)))
    rows = layout.expand([decode, entry(4, 12)])
    assert rows[0] is decode and [len(e.token_ids) for e in rows] == [1] * 5
    for entries, why in [
            ([decode, entry(4, 12), entry(5, 0)], "10 rows: past the largest graph"),
            ([decode, entry(4, 13)], "past the read budget"),
            ([decode, decode], "nothing to expand")]:
        assert layout.expand(entries) is entries, why
    no_graphs = [entry(2, 0)]
    assert RowLayout(0, 10**9).expand(no_graphs) is no_graphs


def test_the_layout_follows_the_captured_graphs_and_the_weight_bytes(monkeypatch):
    report = LoadReport(weight_bytes=10 * 2**20, load_seconds=0.0, num_blocks=8, block_size=16,
                        bytes_per_block=16 * 1024, graph_sizes=(1, 2, 4, 8, 16),
                        graph_seconds=0.0)
    assert RowLayout.of(report) == RowLayout(max_rows=16, max_extra_tokens=10 * 1024)
    eager = LoadReport(**{**vars(report), "graph_sizes": None})
    assert RowLayout.of(eager).max_rows == 0
    monkeypatch.setenv("KVPILOT_ROW_LAYOUT", "0")  # the switch for side-by-side benchmarks
    assert RowLayout.of(report).max_rows == 0


def run(seed: int, async_scheduling: str, layout: RowLayout | None,
        on_engine: Callable[[LLMEngine], None] | None = None) -> tuple[dict, int]:
    """Runs a mixed-load seed's requests (test_engine_mixed_load's draw); gives each
    request's tokens, logprobs and prompt logprobs, and how many steps ran as rows.
    `on_engine` sees the engine once it is built."""
    torch.manual_seed(0)  # the unseeded rows draw the same noise in both runs
    rng = random.Random(seed)
    engine = LLMEngine.from_engine_args(EngineArgs(
        async_scheduling=async_scheduling, model="tiny-llama", num_kv_blocks=40, block_size=4,
        max_num_batched_tokens=32, enable_prefix_caching=True, enable_chunked_prefill=True,
        max_model_len=256, max_num_seqs=8))
    if on_engine is not None:
        on_engine(engine)
    expanded = 0
    if layout is not None:
        engine.rows = layout
        execute = engine.runner.execute

        def counting(entries, copies, prev_tokens=None):
            nonlocal expanded
            assert engine._last_plan is not None  # set before the forward
            expanded += len(entries) > len(engine._last_plan.scheduled)  # rows, not entries
            return execute(entries, copies, prev_tokens)

        engine.runner.execute = counting  # type: ignore[method-assign]
    for i in range(12):
        prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            prompt = list(range(10, 40)) + prompt[:5]  # shared prefixes: prompt tails
        engine.add_request(str(i), prompt, draw_params(rng, i))
    outputs, done, prompt_lps = Outputs(), {}, {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            if delta.prompt_logprobs:
                prompt_lps[delta.request_id] = delta.prompt_logprobs
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs, c.finish_reason)
                                        for c in out.outputs]
    assert len(done) == 12
    return {rid: (completions, prompt_lps.get(rid)) for rid, completions in done.items()}, \
        expanded


def assert_close(want: list, got: list) -> None:
    """Asserts two lists of per-token logprob maps hold the same tokens, ranks and values. A
    token deep in the tail may swap places with a neighbour whose logprob is within float32
    rounding of its own (seen: rank 674 against 675 at -7.0586, the values 5e-7 apart), so
    ranks past the first 20 may differ by one."""
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4, (t, a[t], b[t])
                assert a[t].rank == b[t].rank or (
                    min(a[t].rank, b[t].rank) > 20 and abs(a[t].rank - b[t].rank) == 1), \
                    (t, a[t], b[t])


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("seed", [7, 15])
def test_every_kind_of_request_gives_the_same_output_as_rows(seed, async_scheduling):
    plain, _ = run(seed, async_scheduling, None)
    rows, expanded = run(seed, async_scheduling, RowLayout(max_rows=64, max_extra_tokens=10**6))
    assert expanded > 5, "hardly any step ran as rows"
    assert any(prompt_lps for _, prompt_lps in plain.values())  # "all" rows were expanded too
    for rid, (completions, prompt_lps) in plain.items():
        got, got_prompt_lps = rows[rid]
        assert [c[0] for c in got] == [c[0] for c in completions], rid
        assert [c[2] for c in got] == [c[2] for c in completions], rid
        for (_, want_lp, _), (_, got_lp, _) in zip(completions, got, strict=True):
            assert_close(want_lp or [], got_lp or [])
        assert_close(prompt_lps or [], got_prompt_lps or [])
