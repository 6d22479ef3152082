"""What lets the grammar mask fill scale across cores: each constrained request compiles its
own llguidance matcher (a deep copy shares the original's lexer behind one lock held for a
whole mask) or gets its own xgrammar matcher of the schema compiled once, and the parallel
fill gets one thread per CPU the process may use."""

from __future__ import annotations

import json

import llguidance
import pytest
import xgrammar

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.engine.structured import matchers
from kvpilot.engine.structured.xgrammar_backend import XgrammarMatchers

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
          "additionalProperties": False}


def test_each_request_of_one_schema_compiles_its_own_matcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[llguidance.LLMatcher] = []
    real = matchers.new_matcher

    def counting(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        compiled.append(real(tokenizer, grammar))
        return compiled[-1]

    monkeypatch.setattr(matchers, "new_matcher", counting)
    llm = LLM("tiny-qwen3", device="cpu", structured_outputs_backend="guidance")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=
                             StructuredOutputsParams(json=json.dumps(SCHEMA)))
              for seed in (0, 2, 3)]  # seeds whose integers end within max_tokens
    outs = llm.generate([[5, 6, 7]] * len(params), params)
    assert len(compiled) == 3 and len({id(m) for m in compiled}) == 3
    for out in outs:
        assert set(json.loads(out.outputs[0].text)) == {"id"}


def test_each_request_of_one_schema_gets_its_own_xgrammar_matcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    made: list[xgrammar.GrammarMatcher] = []
    real_compile = xgrammar.GrammarCompiler.compile_grammar
    real_matcher = XgrammarMatchers.matcher

    def compiling(self: xgrammar.GrammarCompiler, grammar: xgrammar.Grammar
                  ) -> xgrammar.CompiledGrammar:
        compiled.append(str(grammar))
        return real_compile(self, grammar)

    def making(self: XgrammarMatchers, schema: str, resumed: list[int]
               ) -> xgrammar.GrammarMatcher:
        made.append(real_matcher(self, schema, resumed))
        return made[-1]

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", compiling)
    monkeypatch.setattr(XgrammarMatchers, "matcher", making)
    llm = LLM("tiny-qwen3", device="cpu")  # auto: this schema goes to xgrammar
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=
                             StructuredOutputsParams(json=json.dumps(SCHEMA)))
              for seed in (0, 2, 3)]
    outs = llm.generate([[5, 6, 7]] * len(params), params)
    assert len(made) == 3 and len({id(m) for m in made}) == 3
    assert len(set(compiled)) == 1  # one schema: the compiler's cache holds its grammar
    for out in outs:
        assert set(json.loads(out.outputs[0].text)) == {"id"}


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (16, 15), (64, 32)])
def test_the_fill_uses_every_cpu_but_the_engines_up_to_32(monkeypatch: pytest.MonkeyPatch,
                                                           cpus: int, threads: int) -> None:
    # the engine's thread books and schedules while the fill runs; at least one fill thread
    monkeypatch.setattr(matchers.os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    assert matchers.fill_threads() == threads
