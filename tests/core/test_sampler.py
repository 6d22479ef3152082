"""Sampler tables on hand-made logits: greedy, filters, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.worker.sampler import Sampler, SamplingRow, prompt_logprobs

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])
# the fused kernel runs on the GPU where there is one (Triton's interpreter on CPU otherwise)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def row(prompt=(), output=(), seed=None, banned=None, num_logprobs=0, **params) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**params), [*prompt, *output], len(prompt), generator,
                       banned, num_logprobs)


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(temperature=0), 1),
    (dict(temperature=1.0, top_k=1), 1),  # only the best token survives
    (dict(temperature=1.0, top_p=0.01), 1),
    (dict(temperature=1.0, min_p=1.0), 1),
    (dict(temperature=0, banned=[1]), 2),  # eos/stop ids banned below min_tokens
    # repetition penalty 10 on a seen positive logit: 3.0 -> 0.3, so token 2 wins
    (dict(temperature=0, output=[1], repetition_penalty=10.0), 2),
    (dict(temperature=0, prompt=[1], repetition_penalty=10.0), 2),  # prompt tokens count too
    # frequency: 3.0 - 2 * 0.6 = 1.8 < 2.0; presence: 3.0 - 1.5 = 1.5
    (dict(temperature=0, output=[1, 1], frequency_penalty=0.6), 2),
    (dict(temperature=0, output=[1, 1], frequency_penalty=0.4), 1),
    (dict(temperature=0, output=[1], presence_penalty=1.5), 2),
    # repetition on a negative logit makes it more negative: -1.0 * 10 stays last
    (dict(temperature=0, output=[4], repetition_penalty=10.0), 1),
    # logit_bias (issue 49: it was refused): -100 bans the best token, +100 lifts the worst
    (dict(temperature=0, logit_bias={1: -100.0}), 2),
    (dict(temperature=0, logit_bias={4: 100.0}), 4),
    (dict(temperature=1.0, logit_bias={4: 100.0}, seed=3), 4),
    (dict(temperature=0, logit_bias={2: 0.5, 1: -0.6}), 2),  # 2.5 against 2.4
])
def test_single_row(kwargs, expected):
    assert Sampler()(LOGITS, [row(**kwargs)]).token_ids == [expected]


def test_rows_are_independent_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    rows = [row(temperature=0), row(temperature=0, banned=[1]), row(temperature=1.0, top_k=1)]
    assert Sampler()(logits, rows).token_ids == [1, 2, 1]


def test_seeded_rows_are_reproducible_and_unaffected_by_neighbours():
    logits = torch.randn(1, 50).repeat(4, 1)
    first = Sampler()(logits, [row(temperature=1.0, seed=5), row(temperature=1.0),
                               row(temperature=1.0, seed=6), row(temperature=0)])
    again = Sampler()(logits[:3], [row(temperature=1.0, seed=6), row(temperature=1.0, seed=5),
                                   row(temperature=1.0)])
    assert again.token_ids[1] == first.token_ids[0]
    assert again.token_ids[0] == first.token_ids[2]


def test_logprobs_are_raw_with_ranks_and_top_alternatives():
    out = Sampler()(LOGITS, [row(temperature=0, output=[1], repetition_penalty=10.0,
                                 num_logprobs=2, logprobs=2)])
    raw = LOGITS.log_softmax(-1)[0]
    assert out.token_ids == [2]
    assert out.logprobs[0] == pytest.approx(raw[2].item())
    assert out.ranks == [2]  # token 1 is more likely in the raw distribution
    assert out.top_ids == [[1, 2]]
    assert out.top_logprobs[0] == pytest.approx([raw[1].item(), raw[2].item()])


def test_prompt_logprobs_score_each_next_token():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    scored = prompt_logprobs(logits, [1, 0], 1)
    lp = logits.log_softmax(-1)
    assert [s[0] for s in scored] == pytest.approx([lp[0, 1].item(), lp[1, 0].item()])
    assert [s[1] for s in scored] == [2, 1]
    assert [s[2] for s in scored] == [[2], [0]]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), top_k=st.integers(0, 8), top_p=st.floats(0.05, 1.0),
       min_p=st.floats(0.0, 0.9), temperature=st.floats(0.1, 2.0))
def test_sampled_token_survives_every_filter(seed, top_k, top_p, min_p, temperature):
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(seed))
    r = row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    token = Sampler()(logits, [r]).token_ids[0]
    order = logits[0].argsort(descending=True).tolist()
    if top_k:
        assert token in order[:top_k]
    probs = (logits[0] / temperature).softmax(-1)
    assert probs[token] >= min_p * probs.max() - 1e-6
    assert not math.isinf(logits[0, token].item())


@pytest.mark.parametrize("vocab", [4096, 128256, 151936, 1000])
def test_two_pass_argmax_is_torchs_argmax_ties_included(vocab):
    from kvpilot.engine.worker.sampler import argmax_rows

    gen = torch.Generator().manual_seed(vocab)
    # few distinct values: every row has ties, across chunk boundaries too
    logits = torch.randint(0, 6, (5, vocab), generator=gen).float()
    logits[1, -1] = 9.0  # the max in the last chunk
    logits[2, 0] = 9.0  # and in the first
    assert torch.equal(argmax_rows(logits, two_pass=True), logits.argmax(dim=-1))
    # a column slice (a TP LM head's padded vocabulary cut off) is not contiguous
    wide = torch.cat([logits, torch.zeros(5, 7)], dim=1)[:, :vocab]
    assert torch.equal(argmax_rows(wide, two_pass=True), logits.argmax(dim=-1))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the dtype of every logits tensor the fused Gumbel-max kernel gets (it still runs,
    in Triton's interpreter on CPU)."""
    from kvpilot.kernels import sampling

    calls: list[torch.dtype] = []
    real = sampling.gumbel_max_sample

    def spy(logits, temperature, seed, *args, **kwargs):
        calls.append(logits.dtype)
        return real(logits, temperature, seed, *args, **kwargs)

    monkeypatch.setattr(sampling, "gumbel_max_sample", spy)
    return calls


def test_fused_sampler_draws_temperature_only_rows_with_the_kernel(kernel_calls):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=gen).to(torch.bfloat16).to(DEVICE)
    rows = [row(temperature=0.6), row(temperature=0, output=[5], repetition_penalty=2.0),
            row(temperature=1.0, banned=[7, 8]), row(temperature=0.8, top_k=-1, beam_width=1)]
    torch.manual_seed(0)
    ids = Sampler(fused=True)(logits, rows).token_ids
    assert kernel_calls == [torch.float32]  # a penalty gave float32 logits
    # greedy rows stay exact: the torch path's argmax of the same penalised logits
    assert ids[1] == Sampler()(logits[1:2], rows[1:2]).token_ids[0]
    assert ids[2] not in (7, 8)
    torch.manual_seed(0)
    assert Sampler(fused=True)(logits, rows).token_ids == ids  # torch's seed repeats the draw
    # no processing: the kernel reads the model's bf16 logits, no float32 copy
    Sampler(fused=True)(logits, [row(temperature=0.6)] * 4)
    assert kernel_calls[-1] == torch.bfloat16


def test_greedy_rows_of_bf16_logits_pick_what_float32_picks():
    """An all-greedy batch reads the model's bf16 logits without widening them: ties (common
    in bf16) and every row's pick match the argmax of the float32 copy."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 5000, generator=gen) * 4).round().to(torch.bfloat16)
    rows = [row(temperature=0)] * 5 + [row(temperature=0, banned=[int(logits[5].argmax())])]
    ids = Sampler(fused=True)(logits, rows).token_ids
    wide = logits.float()
    wide[5, rows[5].banned_token_ids] = float("-inf")
    assert ids == wide.argmax(dim=-1).tolist()


def test_fused_sampler_keeps_the_grammars_mask(kernel_calls):
    logits = torch.zeros(2, 64, device=DEVICE)
    bitmask = torch.tensor([[1 << 5 | 1 << 9, 0], [0, 1 << 3]], dtype=torch.int32)
    for _ in range(3):
        ids = Sampler(fused=True)(logits, [row(temperature=2.0), row(temperature=0.5)],
                                  bitmask).token_ids
        assert ids[0] in (5, 9) and ids[1] == 35
    assert len(kernel_calls) == 3


@pytest.mark.parametrize("other", [dict(seed=5), dict(top_p=0.9), dict(top_k=3),
                                   dict(min_p=0.1), dict(temperature=0)])
def test_fused_sampler_falls_back_unless_every_row_is_temperature_only(kernel_calls, other):
    """A seeded or filtered row sends the whole batch down the torch path, tokens included;
    so does an all-greedy batch."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    first = row(temperature=0) if other.get("temperature") == 0 else row(temperature=0.7)
    rows = [first, row(**{"temperature": 0.7, **other})]
    torch.manual_seed(11)
    fused = Sampler(fused=True)(logits, rows).token_ids
    rows = [first, row(**{"temperature": 0.7, **other})]  # a fresh generator for a seeded row
    torch.manual_seed(11)
    assert fused == Sampler()(logits, rows).token_ids
    assert kernel_calls == []
