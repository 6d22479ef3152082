"""The rejection sampler keeps the target distribution exactly: chi-square over many draws on
a 6-token vocabulary, per emitted position, for model drafts and point-mass (n-gram) drafts;
plus the greedy rule as a table."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.spec_decode.rejection_sampler import rejection_sample

VOCAB, K, DRAWS = 6, 3, 100_000
# chi-square critical value, 5 degrees of freedom (VOCAB - 1), alpha = 1e-4: the draws are
# seeded, so this is a fixed check, and a biased rule lands far above it
CHI2_CRITICAL = 25.74


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Gives Pearson's statistic of `tokens` against the expected `probs`."""
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def draw(with_draft_model: bool, seed: int):
    """Gives (p, q, output) of DRAWS verifications of K drafts sampled from q (or of the
    point-mass drafts argmax p, which pass often enough to reach every position)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, VOCAB, generator=gen) ** 2
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.rand(K, VOCAB, generator=gen) ** 3
    q = q / q.sum(dim=-1, keepdim=True)
    if with_draft_model:
        drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True, generator=gen)
                              for j in range(K)], dim=1)
        draft_probs = q.expand(DRAWS, K, VOCAB)
    else:  # a point-mass draft: the same tokens every time
        drafts = p[:K].argmax(dim=-1).expand(DRAWS, K)
        draft_probs = None
    out = rejection_sample(p.expand(DRAWS, K + 1, VOCAB), drafts,
                           torch.full((DRAWS,), K), draft_probs,
                           torch.rand(DRAWS, K, generator=gen),
                           torch.empty(DRAWS, VOCAB).exponential_(generator=gen))
    return p, q, out


@pytest.mark.parametrize("with_draft_model", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_every_emitted_position_follows_the_target(with_draft_model, seed):
    p, _, out = draw(with_draft_model, seed)
    for pos in range(K + 1):
        reached = out.num_accepted >= pos  # rows that emit a token at `pos`
        assert reached.sum() > 1000, f"too few draws reach position {pos} to test it"
        stat = chi_square(out.token_ids[reached, pos], p[pos])
        assert stat < CHI2_CRITICAL, f"position {pos}: chi-square {stat:.1f}"


def test_acceptance_follows_min_one_p_over_q():
    """The first draft is accepted with probability sum_x q(x) min(1, p(x)/q(x))."""
    p, q, out = draw(True, 3)
    expected = float(torch.minimum(p[0], q[0]).sum())
    observed = float((out.num_accepted >= 1).double().mean())
    assert abs(observed - expected) < 0.01


def one_hot(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), VOCAB).float()


@pytest.mark.parametrize("argmaxes, drafts, num_draft, expected, accepted", [
    ([1, 2, 3, 4], [1, 2, 3], 3, [1, 2, 3, 4], 3),   # all accepted, bonus is the last argmax
    ([1, 2, 3, 4], [1, 5, 3], 3, [1, 2, -1, -1], 1),  # second mismatch: the argmax replaces it
    ([0, 2, 3, 4], [1, 2, 3], 3, [0, -1, -1, -1], 0),  # first mismatch
    ([1, 2, 3, 4], [1, 2, 0], 2, [1, 2, 3, -1], 2),  # padding past num_draft is ignored
    ([5, 2, 3, 4], [0, 0, 0], 0, [5, -1, -1, -1], 0),  # no draft: a plain decode
])
def test_greedy_rows_accept_while_the_argmax_matches(argmaxes, drafts, num_draft, expected,
                                                     accepted):
    out = rejection_sample(one_hot(argmaxes)[None], torch.tensor([drafts]),
                           torch.tensor([num_draft]), None, torch.full((1, K), 0.999),
                           torch.ones(1, VOCAB))
    assert out.token_ids[0].tolist() == expected
    assert int(out.num_accepted[0]) == accepted


def test_the_greedy_shortcut_emits_what_the_sampler_emits_for_point_masses():
    # the engine verifies all-greedy batches by comparing argmaxes (`_verify_greedy`); the
    # sampler with one-hot p and q must agree on every row: padding past a row's drafts
    # (here equal to the target there, which only the draft count rejects), all accepted,
    # a first-position rejection
    from kvpilot.engine.spec_decode.spec_decoder import _verify_greedy

    gen = torch.Generator().manual_seed(4)
    batch = 64
    target = torch.randint(0, 3, (batch, K + 1), generator=gen)  # ties with drafts are common
    drafts = torch.randint(0, 3, (batch, K), generator=gen)
    num_draft = torch.randint(1, K + 1, (batch,), generator=gen)
    pad = torch.arange(K)[None, :] >= num_draft[:, None]
    drafts = torch.where(pad, target[:, :K], drafts)
    drafts[0] = target[0, :K]
    num_draft[0] = K
    one_hot = torch.nn.functional.one_hot
    out = rejection_sample(one_hot(target, VOCAB).float(), drafts, num_draft,
                           one_hot(drafts, VOCAB).float(), torch.rand(batch, K, generator=gen),
                           torch.empty(batch, VOCAB).exponential_(generator=gen))
    tokens, accepted = _verify_greedy(target, drafts, num_draft)
    assert accepted.tolist() == out.num_accepted.tolist()
    assert 0 < int((accepted < num_draft).sum()) < batch and int(accepted[0]) == K
    for row, a in enumerate(accepted.tolist()):
        assert tokens[row, :a + 1].tolist() == out.token_ids[row, :a + 1].tolist()
