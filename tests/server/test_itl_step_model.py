"""bench/itl_step_model.py: the scheduler's rule on a burst, step by step, with costs that make
every step's time readable (a decode-only step 1 ms, a mixed step 10 ms)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    from itl_step_model import StepCosts, simulate
finally:
    sys.path.remove(str(BENCH))

COSTS = StepCosts(decode_ms=1.0, decode_us_per_seq=0.0, mixed_ms=10.0, prefill_us_per_token=0.0)


@pytest.mark.parametrize(("bound", "itls", "total"), [
    # r0's prefill fills step 1; r1's (4 tokens) rides in steps 2-3 beside r0's decodes: r0 sees
    # two 10 ms ITLs, r1 then decodes alone in 1 ms steps
    (None, [10.0, 10.0, 1.0, 1.0], 32.0),
    # one prefill token per mixed step: r1's prefill ends in a step of its own, later
    (1, [10.0, 10.0, 1.0, 1.0], 42.0),
])
def test_prefill_chunks_beside_decodes_are_long_itls(bound: int | None, itls: list[float],
                                                      total: float) -> None:
    got, elapsed = simulate([4, 4], [3, 3], budget=4, max_num_seqs=2, costs=COSTS,
                            max_prefill_in_mixed=bound)
    assert got == pytest.approx(itls)
    assert elapsed == pytest.approx(total)


def test_max_num_seqs_holds_back_admission() -> None:
    # one sequence at a time: no step ever mixes, every ITL is a decode step
    got, elapsed = simulate([2, 2], [3, 3], budget=8, max_num_seqs=1, costs=COSTS)
    assert got == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert elapsed == pytest.approx(10 + 1 + 1 + 10 + 1 + 1)
