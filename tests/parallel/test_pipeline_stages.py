"""The split rule of pipeline stages (contracts/pipeline.py): contiguous layers, as equal as
the count allows, extras before the last stage; more stages than layers refused (the
operator's planner refuses the same: topology.pipelineParallel <= model.numLayers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.contracts.pipeline import stage_layers
from kvpilot.engine.parallel.stage import PipelineStage

# (layers, stages) -> each stage's layers
SPLITS = [
    ((2, 1), [range(0, 2)]),
    ((2, 2), [range(0, 1), range(1, 2)]),
    ((3, 2), [range(0, 2), range(2, 3)]),
    ((7, 3), [range(0, 2), range(2, 5), range(5, 7)]),
    ((80, 3), [range(0, 27), range(27, 54), range(54, 80)]),
    ((10, 4), [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]),
]


@pytest.mark.parametrize(("shape", "want"), SPLITS, ids=[f"{n}x{pp}" for (n, pp), _ in SPLITS])
def test_split(shape, want):
    layers, stages = shape
    assert [stage_layers(layers, stages, s) for s in range(stages)] == want


@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_every_layer_on_exactly_one_stage(shape):
    layers, stages = shape
    split = [stage_layers(layers, stages, s) for s in range(stages)]
    assert [i for r in split for i in r] == list(range(layers))
    sizes = [len(r) for r in split]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes[-1] == min(sizes)  # the last stage also runs the LM head


@pytest.mark.parametrize("stages", [0, 3])
def test_more_stages_than_layers_refused(stages):
    with pytest.raises(ValueError, match=f"pipeline_parallel_size={stages} does not fit a "
                                         "model of 2 layers"):
        stage_layers(2, stages, 0)


def test_first_and_last_stage():
    first, last = PipelineStage.of(4, 2, 0), PipelineStage.of(4, 2, 1)
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (True, False, False,
                                                                            True)
    whole = PipelineStage.whole(4)
    assert whole.is_first and whole.is_last and whole.layers == range(4)
