"""Which decoder layers each pipeline stage holds: the one split rule of the engine and the
operator (torch-free, so the operator's planner checks against the same rule).

Stages hold contiguous layers, as equal as the layer count allows; when the stages do not
divide the layers, the extra layers go to the stages before the last one (the last stage
also runs the final norm and the LM head), as vLLM's `get_pp_indices` does. Every stage
needs at least one layer: `pipeline_parallel_size <= num_layers`.
"""

from __future__ import annotations


def stage_layers(num_layers: int, pipeline_parallel_size: int, stage: int) -> range:
    """Gives the global indices of the decoder layers stage `stage` holds."""
    if not 1 <= pipeline_parallel_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} does not fit a model of "
            f"{num_layers} layers: each stage needs at least one layer; use 1 to {num_layers}")
    base, extra = divmod(num_layers, pipeline_parallel_size)
    sizes = [base] * pipeline_parallel_size
    # the extra layers go to the stages just before the last (which also runs the LM head)
    for i in range(extra):
        sizes[-2 - i] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])
