"""Driving an `LLMEngine` by hand in tests: one request to its end, in bounded steps."""

from __future__ import annotations

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(engine: LLMEngine, request_id: str, prompt: list[int],
        params: SamplingParams = GREEDY) -> tuple[list[int], EngineCoreOutput]:
    """Runs one request to its end; gives its output token ids and its last delta."""
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    final = None
    for _ in range(300):  # bounded: a stuck engine fails the test instead of hanging it
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens += output.completions[0].token_ids
            if output.finished:
                final = output
    assert not engine.has_unfinished_requests() and final is not None
    return tokens, final
