"""The offline API: `LLM(model).generate(prompts, params)` runs prompts to completion in-process.

The engine core runs in this process and thread, with no IPC: it gives only
finished requests' outputs, each whole, and their text is decoded once
(`request_state`). `kvpilot serve` runs the same core in its own process
(`core_process`) for the API servers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats, RequestOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.request_state import RequestState
from kvpilot.engine.structured.grammar import check_grammar

Prompt = str | list[int]  # text, or its token ids
Prompts = Prompt | Sequence[Prompt]


class LLM:
    """Runs an LLMEngine to completion over a list of prompts (tests, benchmarks, scripts)."""

    def __init__(self, model: str, **engine_arg_overrides: Any) -> None:
        from kvpilot.engine.llm_engine import LLMEngine

        self.engine_args = EngineArgs(model=model, **engine_arg_overrides)
        self.engine = LLMEngine.from_engine_args(self.engine_args)
        self.engine.stream_outputs = False  # only final outputs are read here
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> TokenizerLike:
        return self.engine.tokenizer

    def generate(self, prompts: Prompts,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Gives one finished RequestOutput per prompt, in prompt order."""
        prompt_list = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for "
                                 f"{len(prompt_list)} prompts: pass one per prompt or a single one")
        states: dict[str, RequestState] = {}
        for params in params_list:  # what the API server checks before the engine sees it
            if params.structured_outputs is not None:
                check_grammar(params.structured_outputs)
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = f"offline-{next(self._ids)}"
            text, token_ids = ((prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str)
                               else (None, prompt))
            self.engine.add_request(request_id, token_ids, params)
            states[request_id] = RequestState(request_id, text, token_ids, params, self.tokenizer,
                                              stream=False, decode_each_token=False)
        return self._run(states)

    def beam_search(self, prompts: Prompts, params: SamplingParams) -> list[RequestOutput]:
        """Gives, per prompt, the beams sorted best first (outputs[0] is the best sequence)."""
        if params.beam_width < 2:
            raise ValueError(f"beam_width={params.beam_width} is invalid for beam_search: "
                             "pass SamplingParams(beam_width=2 or more)")
        return self.generate(prompts, params)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def _run(self, states: dict[str, RequestState]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                output = states[delta.request_id].apply(delta)
                if output is not None:
                    done[output.request_id] = output
        return [done[i] for i in states]


def _as_list(prompts: Prompts) -> list[Prompt]:
    """Gives the prompts one by one: a lone text or token-id list is one prompt."""
    if isinstance(prompts, str):
        return [prompts]
    token_ids = [p for p in prompts if isinstance(p, int)]
    others = [p for p in prompts if not isinstance(p, int)]
    if token_ids and others:
        raise ValueError("prompts mixes token ids with prompts: pass one list of token ids, "
                         "or a list of prompts (texts or token-id lists)")
    return [token_ids] if token_ids else others
