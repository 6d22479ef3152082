"""Ready means warm (`engine.warmup`): the warm-up runs every code path real traffic takes,
then leaves the engine as it found it.

The check is the engine's own path log: after the warm-up, a path first used by a real
request is logged as cold. A table of every kind of request a user sends must find none;
and taking any one request out of the warm-up must leave a path cold (so the table is
sharp enough to notice a path the warm-up stops covering). On CPU nothing compiles, but
the paths are the engine's, decided on the host, the same as on a GPU.
"""

from __future__ import annotations

import json
import random

import pytest

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.engine_loop import warmup
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

ARGS = dict(model="tiny-llama", num_kv_blocks=96, block_size=4, max_num_batched_tokens=32,
            max_model_len=256, max_num_seqs=8, warmup="on")
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})


def traffic() -> list[tuple[str, list[int], SamplingParams]]:
    """Gives every kind of request a user sends (each sampler option, structured output,
    prefix hits, prompts longer than the step budget)."""
    rng = random.Random(3)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 1000) for _ in range(n)]

    shared = prompt(40)
    kinds = {
        "greedy": SamplingParams(temperature=0, max_tokens=6),
        "temperature": SamplingParams(temperature=0.7, max_tokens=6),
        "top-p": SamplingParams(temperature=0.7, top_p=0.8, max_tokens=6),
        "top-k": SamplingParams(temperature=0.7, top_k=5, max_tokens=6),
        "min-p": SamplingParams(temperature=0.7, min_p=0.1, max_tokens=6),
        "seed": SamplingParams(temperature=0.7, seed=3, max_tokens=6),
        "presence": SamplingParams(temperature=0, presence_penalty=1.0, max_tokens=6),
        "repetition": SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=6),
        "logprobs": SamplingParams(temperature=0, logprobs=3, max_tokens=6),
        "logit-bias": SamplingParams(temperature=0.7, logit_bias={7: 2.0}, max_tokens=6),
        "prompt-logprobs": SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=6),
        "min-tokens": SamplingParams(temperature=0, min_tokens=4, max_tokens=6),
        "json": SamplingParams(temperature=0, max_tokens=6,
                               structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    out = [(name, prompt(rng.randint(3, 30)), params) for name, params in kinds.items()]
    out += [("long", prompt(120), SamplingParams(temperature=0, max_tokens=4)),
            ("shared-1", shared + prompt(5), SamplingParams(temperature=0, max_tokens=4)),
            ("shared-2", shared + prompt(9), SamplingParams(temperature=0, max_tokens=4))]
    return out


def serve(engine: LLMEngine) -> None:
    """Serves a lone temperature-only request (a batch the fused sampling kernel draws on a
    GPU, as one chat request's is), then the whole table at once."""
    requests = traffic()
    alone = [r for r in requests if r[0] == "temperature"]
    for wave in (alone, requests):
        for name, prompt, params in wave:
            engine.add_request(f"{name}-{len(wave)}", prompt, params)
        for _ in range(3000):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        else:
            raise AssertionError("the traffic did not finish")


@pytest.mark.parametrize("mixed_graphs", ["0", "full", "1"])
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_after_the_warm_up_no_request_takes_a_path_it_did_not_run(monkeypatch, async_scheduling,
                                                                   mixed_graphs):
    """Under each way mixed steps run: eagerly, and the GPU's graphs (attention inside them,
    the default, or outside), whose pieces a CPU calls rather than replays."""
    monkeypatch.setenv("KVPILOT_PIECEWISE_GRAPHS", mixed_graphs)
    engine = LLMEngine.from_engine_args(EngineArgs(**ARGS, async_scheduling=async_scheduling))
    assert engine.paths.warm is not None
    assert {"prefill:fresh", "prefill:cached-prefix", "structured-outputs",
            "sampler:penalties", "sampler:temperature", "sampler-batch:fused",
            "sampler-batch:torch"} <= engine.paths.warm
    serve(engine)
    assert engine.paths.cold == []


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_lone_temperature_request_finds_its_sampling_kernel_warm(async_scheduling):
    """With a budget that takes every warm-up prompt in one step (as a GPU's does), a
    temperature-only batch still ran in the warm-up: a lone chat request's batch, drawn by
    the fused kernel on CUDA (its first use compiled it: ~1 s of the first TTFT on an H200)."""
    engine = LLMEngine.from_engine_args(EngineArgs(**{
        **ARGS, "max_num_batched_tokens": 256, "num_kv_blocks": 300},
        async_scheduling=async_scheduling))
    assert engine.paths.warm is not None and "sampler-batch:fused" in engine.paths.warm
    engine.add_request("chat", [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.paths.cold == []


def test_the_warm_up_leaves_nothing_behind():
    engine = LLMEngine.from_engine_args(EngineArgs(**ARGS))
    stats = engine.get_stats()
    assert engine.requests == {} and not engine.has_unfinished_requests()
    assert engine.kv.pool.cached == {}  # its prompts are not prefix hits for anyone
    assert stats.kv_cache_usage == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert (stats.prompt_tokens, stats.generation_tokens, stats.prefix_cache_queries,
            stats.eager_steps, stats.step_seconds, stats.iteration_tokens_sum) == (
        0, 0, 0, 0, {}, 0)


@pytest.mark.parametrize("left_out", ["prefix-hit", "random", "top", "penalties", "logit-bias",
                                      "logprobs", "structured"])
def test_a_path_left_out_of_the_warm_up_is_caught(monkeypatch, left_out):
    requests = warmup._requests

    def without(engine):
        kept, wide = requests(engine)
        assert left_out in [r.name for r in kept]
        return [r for r in kept if r.name != left_out], wide

    monkeypatch.setattr(warmup, "_requests", without)
    # a budget that no warm-up prompt but the widest fills: no other prompt is chunked, so
    # only the prefix hit continues a cached prefix
    engine = LLMEngine.from_engine_args(EngineArgs(**{**ARGS, "max_num_batched_tokens": 256,
                                                      "num_kv_blocks": 300}))
    serve(engine)
    assert engine.paths.cold, f"leaving {left_out!r} out of the warm-up went unnoticed"


def test_speculative_verifies_are_warmed_when_configured():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    engine = LLMEngine.from_engine_args(EngineArgs(**ARGS, speculative_config=spec))
    assert engine.paths.warm is not None and "spec:verify" in engine.paths.warm
    assert engine.get_stats().spec_decode_num_drafts == 0  # counters back at zero


def test_auto_skips_the_warm_up_on_cpu():
    engine = LLMEngine.from_engine_args(EngineArgs(**{**ARGS, "warmup": "auto"}))
    assert engine.paths.warm is None  # nothing compiles on a CPU: no warm-up, no cold log
    serve(engine)
    assert engine.paths.cold == []


def test_an_unwritable_compile_cache_is_refused_naming_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    warmup.check_compile_cache({})  # unset: Triton's default
    warmup.check_compile_cache({"TRITON_CACHE_DIR": str(tmp_path / "cache")})
    with pytest.raises(ValueError, match=r"TRITON_CACHE_DIR=.*a-file/cache cannot be written.*"
                                         r"install -d -o 1000"):
        warmup.check_compile_cache({"TRITON_CACHE_DIR": str(blocker / "cache")})


def test_mixed_graph_steps_are_warmed_beside_decode_graphs(monkeypatch):
    """A GPU's steps: decode-only batches (and short prompts laid out as rows) replay the
    decode graphs, a prompt beside decodes runs the mixed graphs up to 512 tokens, wider
    steps eagerly. With a budget over 512 tokens, every warm-up prompt is either a row
    layout's or wider than the mixed graphs unless the warm-up runs a prompt beside a decode
    on purpose. Simulated on CPU: the mixed graphs' pieces are called, decode-only steps
    counted as replays, and the row layout given a GPU's graph sizes."""
    from kvpilot.engine.worker import model_runner, row_layout

    monkeypatch.setenv("KVPILOT_PIECEWISE_GRAPHS", "full")
    monkeypatch.setattr(row_layout.RowLayout, "of", classmethod(
        lambda cls, report: cls(max_rows=64, max_extra_tokens=400)))
    eager_or_mixed = model_runner.ModelRunner.forward

    def forward(self, input_ids, positions, meta, kv_caches):
        if meta.max_query_len == 1:  # a decode graph's step on a GPU
            self.num_graph_steps += 1
            return self.model(input_ids, positions, kv_caches, meta)
        return eager_or_mixed(self, input_ids, positions, meta, kv_caches)

    monkeypatch.setattr(model_runner.ModelRunner, "forward", forward)
    engine = LLMEngine.from_engine_args(EngineArgs(**{
        **ARGS, "max_num_batched_tokens": 1024, "max_model_len": 1100, "num_kv_blocks": 700}))
    assert engine.paths.warm is not None
    assert {"forward:graph", "forward:eager", "forward:full"} <= engine.paths.warm
    # a prompt arriving while another request decodes: the mixed graphs' step
    engine.add_request("decoding", [5] * 6, SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))
    engine.step()
    engine.add_request("arriving", list(range(5, 205)), SamplingParams(temperature=0,
                                                                      max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.paths.cold == []
