"""Gumbel-max sampling: the kernel against its reference on the same Philox uniforms, greedy rows
against torch.argmax, seeds, -inf logits, and the sampled frequencies against softmax(logits / T).

The interpreter runs a program per (row, chunk) in ~20 ms, mostly Philox: the kernel's own
frequency test draws a few hundred tokens; the one with 20000 draws runs the reference on
`kernel_uniforms`, the numbers the kernel draws (the first test checks that they are)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE

from kvpilot.kernels.sampling import (
    gumbel_max_keys,
    gumbel_max_sample,
    gumbel_max_sample_ref,
    kernel_uniforms,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # widened right after the load
NEG_INF = float("-inf")


def sample(logits, temperature, seed, block=None):
    t = torch.as_tensor(temperature, dtype=torch.float32).to(DEVICE)
    return gumbel_max_sample(logits.to(DEVICE), t, torch.tensor([seed], device=DEVICE), block)


def chi_square(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Gives Pearson's statistic of the counts of `ids` against `probs` (tokens of p > 0)."""
    counts = torch.bincount(ids.cpu(), minlength=len(probs)).double()
    expected = probs.double() * len(ids)
    keep = probs > 0
    return float(((counts - expected)[keep] ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("temperature", "vocab", "block"), [
    ([0.6, 1.0, 0.0, 2.0], 1000, 256),  # vocab not a multiple of the block; a greedy row
    ([0.6, 0.6, 0.6], 300, None),  # the default block: one chunk wider than the row
    ([1.0, 0.3], 64, 16),  # four chunks of four columns per quarter
])
def test_kernel_is_its_reference_on_the_same_uniforms(temperature, vocab, block, dtype):
    rows = len(temperature)
    gen = torch.Generator().manual_seed(vocab + rows)
    # rows 4 columns apart in memory: strided rows, dense columns
    wide = (torch.randn(rows, vocab + 4, generator=gen) * 1.5).to(dtype)
    logits = wide[:, :vocab]
    logits[0, :: 7] = NEG_INF
    seed = 1234 + vocab
    ids = sample(logits, temperature, seed, block).cpu()
    keys = gumbel_max_keys(logits, torch.tensor(temperature),
                           kernel_uniforms(seed, rows, vocab, block))
    ref = keys.argmax(dim=-1)
    top2 = keys.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # no float32 rounding can swap these
    assert torch.equal(ids[clear], ref[clear])
    assert clear.sum() >= rows - 1
    assert (keys.gather(1, ids[:, None])[:, 0] >= top2[:, 0] - 1e-3).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_rows_are_torch_argmax_ties_and_inf_included(dtype):
    gen = torch.Generator().manual_seed(7)
    vocab = 200
    # few distinct values: ties in every row, within and across chunks of 32
    logits = torch.randint(0, 4, (5, vocab), generator=gen).to(dtype)
    logits[1, 150] = 9.0  # the max in a late chunk
    logits[2, 31:33] = 9.0  # a tie across a chunk boundary
    logits[3, :100] = NEG_INF  # the max after a masked half
    logits[4, 50:] = NEG_INF
    ids = sample(logits, [0.0] * 5, 99, block=32).cpu()
    assert torch.equal(ids, logits.float().argmax(dim=-1))
    assert ids.tolist()[1:3] == [150, 31]


def test_rows_of_only_minus_inf_give_an_id_inside_the_row():
    logits = torch.full((2, 100), NEG_INF)
    ids = sample(logits, [0.7, 0.0], 5, block=32).cpu()
    assert ((ids >= 0) & (ids < 100)).all()


def test_a_seed_repeats_its_draws_and_another_changes_them():
    logits = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    first = sample(logits, [1.0] * 8, 42)
    assert torch.equal(sample(logits, [1.0] * 8, 42), first)
    assert not torch.equal(sample(logits, [1.0] * 8, 43), first)


def test_no_rows():
    assert sample(torch.empty(0, 10), [], 1).shape == (0,)


LOGITS = torch.tensor([0.0, 0.3, 0.6, 0.9, 1.2, 1.5, 1.8, NEG_INF])  # -inf: a masked token


def test_kernel_draws_softmax_over_temperature():
    """256 draws, each row its own stream: 22.5 is the 0.999 quantile of chi-square with 6
    degrees of freedom; the statistic is 2.5 here, 43 with the kernel's temperature dropped."""
    temperature = 0.6
    ids = sample(LOGITS.repeat(256, 1), [temperature] * 256, 2024)
    probs = (LOGITS / temperature).softmax(-1)
    assert int((ids == 7).sum()) == 0
    assert chi_square(ids, probs) < 22.5


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_the_kernels_uniforms_draw_softmax_over_temperature(temperature):
    """The reference on `kernel_uniforms` (what the kernel computes, checked above) for 20000
    rows: consecutive seeds' streams give independent draws of the right distribution."""
    rows = 20000
    u = kernel_uniforms(77, rows, len(LOGITS))
    ids = gumbel_max_sample_ref(LOGITS.repeat(rows, 1), torch.full((rows,), temperature), u)
    probs = (LOGITS / temperature).softmax(-1)
    assert int((ids == 7).sum()) == 0
    assert chi_square(ids, probs) < 22.5
