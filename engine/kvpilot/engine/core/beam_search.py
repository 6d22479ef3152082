"""Beam selection for the offline API: keep the `beam_width` best (beam, next token) pairs.

All live beams of a request advance in lockstep: each computes its top
candidates, and once every live beam has them, the best pairs by cumulative
logprob survive. A beam chosen k times continues itself and forks k - 1
children that share its blocks (copy-on-write on the partial block); beams
chosen zero times are dropped and their blocks freed.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.engine.core.request import Request, Sequence


def select_beams(request: Request) -> list[tuple[Sequence, int, float]] | None:
    """Gives the surviving (parent, token, token logprob) triples, or None while a beam is pending."""
    live = request.live_seqs()
    if not live:
        return None
    pool: list[tuple[float, int, Sequence, int, float]] = []
    for order, seq in enumerate(live):
        if seq.beam_candidates is None:
            return None
        pool += [(seq.cumulative_logprob + lp, order, seq, token, lp)
                 for lp, token in seq.beam_candidates]
    width = request.params.beam_width - (len(request.seqs) - len(live))
    # ties go to the earlier beam, then the more likely token (stable sort)
    pool.sort(key=lambda item: -item[0])
    return [(seq, token, lp) for _, _, seq, token, lp in pool[:max(width, 1)]]


def apply_selection(request: Request, chosen: list[tuple[Sequence, int, float]],
                    fork: Callable[[Sequence], Sequence], drop: Callable[[Sequence], None],
                    append: Callable[[Sequence, int, float], None]) -> None:
    """Forks, drops and extends the beams of `request` as `chosen` says."""
    used: set[int] = set()
    targets: list[tuple[Sequence, int, float]] = []
    for parent, token, lp in chosen:
        # fork before any token is appended, so children copy the parent's old state
        target = parent if parent.seq_id not in used else fork(parent)
        used.add(parent.seq_id)
        targets.append((target, token, lp))
    for seq in request.live_seqs():
        if seq.seq_id not in used and all(seq is not t for t, _, _ in targets):
            drop(seq)
    for seq, token, lp in targets:
        seq.beam_candidates = None
        append(seq, token, lp)
