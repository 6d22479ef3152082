"""Mixed steps through mixed-step graphs (`worker.piecewise_graphs`): the same tokens and
logprobs as the plain eager forward, for every kind of request.

On CUDA a bucket is one replayed graph (full: attention inside, the unified kernel over
fixed metadata) or one per stretch between attentions (piecewise); on CPU there are no
graphs, so KVPILOT_PIECEWISE_GRAPHS=1 (piecewise) or =full has the runner call the same
work on the same fixed buffers (padding rows with slot -1, padding sequences of length 0,
one shared attention output buffer; full runs the unified Triton kernel in the interpreter):
the path a GPU takes, short of the replay. (tests/kernels/test_cuda_graphs.py compares
replayed graphs against eager on a GPU.)
"""

from __future__ import annotations

import pytest
from test_row_layout import assert_close, run

from kvpilot.engine.worker.piecewise_graphs import ENV, piecewise_mode, token_buckets


def test_buckets_end_at_the_largest_step():
    assert token_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert token_buckets(100) == [16, 32, 64, 96, 100]
    assert token_buckets(16) == [16]


def test_the_switch(monkeypatch):
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (piecewise_mode(cpu), piecewise_mode(cuda)) == (("off", False), ("replay", True))
    monkeypatch.setenv(ENV, "1")
    assert (piecewise_mode(cpu), piecewise_mode(cuda)) == (("call", False), ("replay", False))
    monkeypatch.setenv(ENV, "piecewise")
    assert (piecewise_mode(cpu), piecewise_mode(cuda)) == (("off", False), ("replay", False))
    monkeypatch.setenv(ENV, "full")
    assert (piecewise_mode(cpu), piecewise_mode(cuda)) == (("call", True), ("replay", True))
    monkeypatch.setenv(ENV, "0")
    assert (piecewise_mode(cpu), piecewise_mode(cuda)) == (("off", False), ("off", False))


def counted_run(monkeypatch, seed: int, async_scheduling: str, mode: str):
    monkeypatch.setenv(ENV, mode)
    runs = {}

    def keep(engine) -> None:
        runs["engine"] = engine

    outputs, _ = run(seed, async_scheduling, None, on_engine=keep)
    runner = runs["engine"].runner
    if mode in ("1", "full"):
        assert runner.mixed_graphs.mode == ("full" if mode == "full" else "piecewise")
    return outputs, runner.num_piecewise_steps, runner.num_eager_steps


@pytest.mark.parametrize(("mode", "async_scheduling", "seed"),
                         [("1", "off", 7), ("1", "on", 15), ("full", "off", 15),
                          ("full", "on", 7)])
def test_every_kind_of_request_gives_the_same_output_through_the_pieces(
        monkeypatch, mode, seed, async_scheduling):
    plain, pieces_off, eager_off = counted_run(monkeypatch, seed, async_scheduling, "0")
    assert pieces_off == 0 and eager_off > 0
    pieces, piecewise, eager = counted_run(monkeypatch, seed, async_scheduling, mode)
    # every step fits the 32-token budget's buckets: none runs eagerly
    assert piecewise == eager_off and eager == 0
    assert any(prompt_lps for _, prompt_lps in plain.values())
    for rid, (completions, prompt_lps) in plain.items():
        got, got_prompt_lps = pieces[rid]
        assert [c[0] for c in got] == [c[0] for c in completions], rid
        assert [c[2] for c in got] == [c[2] for c in completions], rid
        for (_, want_lp, _), (_, got_lp, _) in zip(completions, got, strict=True):
            assert_close(want_lp or [], got_lp or [])
        assert_close(prompt_lps or [], got_prompt_lps or [])
