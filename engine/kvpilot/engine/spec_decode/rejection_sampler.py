"""Rejection sampling of draft tokens (Leviathan et al. 2023; vLLM's `RejectionSampler`).

Draft token d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), where
p is the target's distribution at that position and q the draft's; at the first
rejection the token is drawn from norm(max(p_j - q_j, 0)) instead, and when all
drafts pass a bonus token is drawn from p at the position after them. Every
emitted token is then distributed exactly as p. Greedy rows pass one-hot p (the
argmax): a draft is accepted while it equals the argmax, and the token at the
first mismatch (or the bonus) is the argmax itself. A draft without a model
(n-gram) has q = one-hot(d): pass `draft_probs=None`.

Pure: the randomness comes in as `uniform` and `noise` (exponential race), so
tests can drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    """Per row: the emitted tokens (accepted drafts then one more) and how many drafts passed."""

    token_ids: torch.Tensor  # [B, K + 1] long; -1 past the row's last emitted token
    num_accepted: torch.Tensor  # [B] long, in [0, num_draft]


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniform: torch.Tensor, noise: torch.Tensor) -> RejectionOutput:
    """Gives the tokens emitted per row for drafts verified against the target.

    target_probs [B, K + 1, V]: the target's processed distribution at each draft
    position and the one after; draft_token_ids [B, K] (padding past num_draft is
    ignored); num_draft [B]; draft_probs [B, K, V] or None (point-mass drafts);
    uniform [B, K] in [0, 1); noise [B, V] exponential(1), for the one token drawn
    per row (recovered or bonus).
    """
    batch, width, _ = target_probs.shape
    k = width - 1
    dev = target_probs.device
    drafts = draft_token_ids.clamp(min=0)
    p_draft = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, K]
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs.gather(2, drafts[..., None])[..., 0]
        ratio = p_draft / q_draft.clamp(min=1e-20)
    positions = torch.arange(k, device=dev)[None, :]
    accepted = (uniform < ratio.clamp(max=1.0)) & (positions < num_draft[:, None])
    # leading run of accepts: the first False (or num_draft) ends it
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=dev)
    p_next = target_probs[rows, num_accepted]  # [B, V]: where the one drawn token comes from
    rejected = num_accepted < num_draft
    if k:  # computed for every row and kept where one was rejected: no host sync to ask
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, drafts[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at]
        residual = (p_next - q_next).clamp(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # mass 0 means p == q there, where a rejection cannot happen; keep p to stay finite
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-20), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    last = (p_next / noise).argmax(dim=1)
    out = torch.full((batch, width), -1, dtype=torch.long, device=dev)
    keep = positions < num_accepted[:, None]
    out[:, :k] = torch.where(keep, drafts, out[:, :k])
    out[rows, num_accepted] = last
    return RejectionOutput(out, num_accepted)
