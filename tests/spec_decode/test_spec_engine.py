"""Speculative decoding in the engine: greedy output identical to plain decoding (n-gram, a
draft equal to the target, a different draft) on HF-written checkpoints and the built-in
tiny models, while continuous batching, chunked prefill, prefix caching and preemption
really happen; sampling keeps running with a draft = target accepting (almost) everything."""

from __future__ import annotations

import functools
import itertools
import random

import msgspec
import pytest
from helpers.checkpoints import write_checkpoint

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core_process.messages import StepOutputs, from_core_decoder
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.spec_decode.draft_proposer import DraftModelProposer
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.worker.row_layout import RowLayout
from kvpilot.engine.worker.step_batch import BatchEntry

MAX_STEPS = 3000
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, ' \
        '"prompt_lookup_min": 1}'


def draft(model: str, k: int = 3) -> str:
    return f'{{"model": "{model}", "num_speculative_tokens": {k}}}'


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec-checkpoints")
    return {family: str(write_checkpoint(root, family, seed=11)) for family in ("llama", "qwen3")}


def prompts() -> list[list[int]]:
    """Gives 7 prompts: repetitive ones (n-gram hits), a shared 24-token prefix (prefix
    cache hits) and two longer than the step budget (chunked prefill)."""
    rng = random.Random(5)
    shared = [rng.randrange(5, 900) for _ in range(24)]
    out = []
    for i in range(7):
        if i % 3 == 0:
            motif = [rng.randrange(5, 900) for _ in range(rng.randrange(2, 5))]
            out.append(motif * rng.randrange(3, 6))
        elif i % 3 == 1:
            out.append(shared + [rng.randrange(5, 900) for _ in range(rng.randrange(1, 9))])
        else:
            out.append([rng.randrange(5, 900) for _ in range(rng.randrange(30, 60))])
    return out


@functools.cache
def plain_greedy(model: str) -> dict[str, list[int]]:
    """Gives the prompts' greedy outputs without speculation (once per model)."""
    out, stats = generate(model, None)
    assert stats.spec_decode_num_accepted_tokens_per_pos == []
    return out


def generate(model: str, spec: str | None, temperature: float = 0.0, seed: int | None = None,
             layout: RowLayout | None = None) -> tuple[dict[str, list[int]], EngineStats]:
    """Runs the prompts on a tight pool (preemption), a 24-token budget (chunked prefill),
    half of them added while the first half decodes (continuous batching); `layout`
    replaces the row layout the engine chose (none expands on CPU: no graphs)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, num_kv_blocks=28, block_size=4, max_num_batched_tokens=24,
        max_num_seqs=6, speculative_config=spec))
    if layout is not None:
        engine.rows = layout
        if isinstance(engine.spec.proposer if engine.spec else None, DraftModelProposer):
            engine.spec.proposer.rows = layout  # type: ignore[union-attr]
    engine.stream_outputs = False
    todo = list(enumerate(prompts()))
    out: dict[str, list[int]] = {}
    for step in range(MAX_STEPS):
        if todo and (step % 3 == 0):
            i, prompt = todo.pop(0)
            params = SamplingParams(max_tokens=14 + 2 * i, temperature=temperature, ignore_eos=True,
                                    seed=None if seed is None else seed + i)
            engine.add_request(str(i), prompt, params)
        if not todo and not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.completions[0].token_ids)
    assert not todo and not engine.has_unfinished_requests()
    return out, engine.get_stats()


def assert_everything_happened(stats: EngineStats) -> None:
    assert stats.num_preemptions > 0, "the pool never ran short: make it tighter"
    assert stats.prefix_cache_hits > 0, "no prefix-cache hit"
    assert stats.spec_decode_num_drafts > 0
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == 3
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "draft=target", "draft=other"])
def test_greedy_output_is_unchanged_on_hf_checkpoints(checkpoints, family, method):
    target = checkpoints[family]
    other = checkpoints["qwen3" if family == "llama" else "llama"]
    spec = {"ngram": NGRAM, "draft=target": draft(target), "draft=other": draft(other)}[method]
    fast, stats = generate(target, spec)
    assert fast == plain_greedy(target)
    assert_everything_happened(stats)
    if method == "draft=target":  # the same model proposes exactly what greedy verifies
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if method != "draft=other":  # two random models rarely agree: its drafts get rejected
        assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("model, spec", [
    ("tiny-llama", NGRAM),
    ("tiny-llama", draft("tiny-llama")),
    ("tiny-llama", draft("tiny-qwen3")),
    ("tiny-qwen3", draft("tiny-mixtral", k=2)),
])
def test_greedy_output_is_unchanged_on_builtin_models(model, spec):
    fast, stats = generate(model, spec)
    assert fast == plain_greedy(model)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_drafts > 0


def test_sampling_with_draft_equal_to_target_accepts_nearly_everything():
    """p == q up to rounding, so min(1, p/q) is ~1: nearly every draft passes; seeded runs
    repeat exactly."""
    first, stats = generate("tiny-llama", draft("tiny-llama"), temperature=0.9, seed=3)
    again, _ = generate("tiny-llama", draft("tiny-llama"), temperature=0.9, seed=3)
    assert first == again
    assert stats.spec_decode_num_draft_tokens > 50
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert rate > 0.95


def test_requests_that_sample_on_the_host_decode_without_drafts():
    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=64,
                                                   speculative_config=NGRAM))
    engine.add_request("lp", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=8, logprobs=1))
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().spec_decode_num_drafts == 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    path = write_checkpoint(tmp_path, "llama", vocab_size=300)
    with pytest.raises(ValueError, match=r"vocab_size=300 .* must share the target's tokenizer"):
        LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=16, max_model_len=512,
                                              speculative_config=draft(str(path))))


def test_metrics_page_carries_the_spec_decode_counters():
    metrics = ServerMetrics("m")
    metrics.set_stats(EngineStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                                  spec_decode_num_accepted_tokens=7,
                                  spec_decode_num_accepted_tokens_per_pos=[4, 2, 1]))
    page = metrics.render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 4.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}'
                 ' 1.0'):
        assert line in page
    plain = ServerMetrics("m")
    plain.set_stats(EngineStats())
    assert "spec_decode" not in plain.render().decode()


def test_spec_counters_cross_the_core_process_boundary():
    stats = EngineStats(spec_decode_num_drafts=2, spec_decode_num_accepted_tokens_per_pos=[2, 1])
    step = StepOutputs([], stats)
    assert from_core_decoder().decode(msgspec.msgpack.encode(step)) == step


def test_rejected_draft_slots_are_freed_after_every_step():
    """A draft model that disagrees (another random model) gets most drafts rejected; after
    every step each running decode holds exactly the blocks of its verified tokens, and the
    pool's blocks are all either free or in a table."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", num_kv_blocks=48, block_size=4,
        speculative_config=draft("tiny-qwen3", k=4)))
    for i, prompt in enumerate(prompts()[:4]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, ignore_eos=True,
                                                          temperature=0.0))
    kv = engine.kv
    checked = 0
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_pending_tokens == 1:  # a decode between steps
                assert len(kv.block_ids(seq)) == -(-seq.num_computed_tokens // 4)
                checked += 1
        owned = {b.block_id for table in kv.block_tables.values() for b in table}
        assert len(owned) + kv.pool.num_free_blocks == kv.num_blocks
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert checked > 20
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
    "n": {"type": "integer"}}, "required": ["name", "ok", "n"], "additionalProperties": False}


def constrained(spec: str | None, **sampling) -> tuple[list[str], EngineStats]:
    """Gives JSON-schema and regex outputs of tiny-llama (with `spec`) and the stats."""
    import json

    from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
    from kvpilot.engine.entrypoints.llm import LLM

    llm = LLM("tiny-llama", device="cpu", num_kv_blocks=128, speculative_config=spec)
    grammars = [StructuredOutputsParams(json=json.dumps(SCHEMA)),
                StructuredOutputsParams(regex="(ab|abc|x[0-9]{2}){3,6}")]
    outs = llm.generate(["Reply in JSON:", "Count:"] * 2, [SamplingParams(
        max_tokens=80, structured_outputs=grammars[i % 2], seed=i, **sampling)
        for i in range(4)])
    return [o.outputs[0].text for o in outs], llm.get_stats()


@pytest.mark.parametrize("spec", [draft("tiny-llama"), NGRAM])
def test_structured_requests_speculate_within_their_grammar(spec):
    """Each verify row is masked by the grammar's state after the drafts before it: greedy
    output equals plain constrained decoding (n-gram drafts often break the grammar, a draft
    equal to the target never does), and sampled outputs keep to the grammar."""
    import json
    import re

    plain, _ = constrained(None, temperature=0)
    fast, stats = constrained(spec, temperature=0)
    assert fast == plain
    assert stats.spec_decode_num_drafts > 0
    sampled, stats = constrained(spec, temperature=1.0)
    for i, text in enumerate(sampled):
        if i % 2 == 0:
            assert set(json.loads(text)) == {"name", "ok", "n"}
        else:
            assert re.fullmatch("(ab|abc|x[0-9]{2}){3,6}", text), text
    assert stats.spec_decode_num_drafts > 0


def test_the_draft_catches_up_on_accepted_drafts_in_single_token_rows(monkeypatch):
    # draft = target accepts every draft, so each round leaves the last draft and the bonus
    # token past the draft's K/V: they must reach the draft's runner as single-token rows (a
    # step of those replays the draft's decode graph on CUDA, where the draft's row layout
    # allows it; forced here; a 2-token entry made the step eager)
    runs: list[tuple[ModelRunner, list[int]]] = []
    execute = ModelRunner.execute

    def recording(self, entries, copies, prev_tokens=None):
        runs.append((self, [len(e.token_ids) for e in entries]))
        return execute(self, entries, copies, prev_tokens)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    fast, stats = generate("tiny-llama", draft("tiny-llama", k=3),
                           layout=RowLayout(max_rows=64, max_extra_tokens=10**6))
    # the target runs first (the draft only follows decodes): the others are the draft's
    lengths = [step for runner, step in runs if runner is not runs[0][0]]
    assert fast == plain_greedy("tiny-llama")
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    short = [n for step in lengths for n in step if 1 < n <= 4]  # k + 1 = 4
    assert not short, f"catch-up entries of {sorted(set(short))} tokens"
    assert sum(step.count(1) for step in lengths) > len(lengths)  # rows of one token abound


@pytest.mark.parametrize("spec", [NGRAM, draft("tiny-llama")])
def test_verify_entries_run_as_single_token_rows_with_the_same_output(monkeypatch, spec):
    # where decode graphs exist, a step of decodes and verifies runs each verify entry as
    # one row per token (a graph replay); forced here on CPU, the output stays the same
    runs: list[tuple[ModelRunner, list[BatchEntry]]] = []
    execute = ModelRunner.execute

    def recording(self, entries, copies, prev_tokens=None):
        runs.append((self, list(entries)))
        return execute(self, entries, copies, prev_tokens)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    fast, stats = generate("tiny-llama", spec, layout=RowLayout(max_rows=64,
                                                                max_extra_tokens=10**6))
    assert fast == plain_greedy("tiny-llama")
    assert stats.spec_decode_num_accepted_tokens > 0
    # the target's steps (it runs first: the draft only follows decodes): rows sharing one
    # block table are an expanded verify, and no step of only decodes and verifies kept a
    # multi-token entry
    steps = [entries for runner, entries in runs if runner is runs[0][0]]
    expanded = [step for step in steps
                if any(a.block_ids is b.block_ids for a, b in itertools.pairwise(step))]
    assert expanded, "no verify entry ran as single-token rows"
    assert all(len(e.token_ids) == 1 for step in expanded for e in step)
    assert not [step for step in steps if any(e.logits == "all" for e in step)
                and all(len(e.token_ids) == 1 or e.logits == "all" for e in step)]


def test_sampled_output_is_unchanged_when_verify_entries_run_as_rows():
    # seeded sampling through rejection: the rows give the verify entries' logits
    rows = RowLayout(max_rows=64, max_extra_tokens=10**6)
    plain, _ = generate("tiny-llama", draft("tiny-qwen3"), temperature=0.9, seed=3)
    expanded, stats = generate("tiny-llama", draft("tiny-qwen3"), temperature=0.9, seed=3,
                               layout=rows)
    assert expanded == plain
    assert stats.spec_decode_num_draft_tokens > 50
