"""LoRA adapters in the engine against HF transformers + PEFT: each alone, a mixed batch of
three adapters and the base in one forward, slot eviction, and the prefix cache."""

from __future__ import annotations

import random

import pytest
from helpers.engine_run import GREEDY, run
from helpers.lora_adapters import hf_greedy

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.lora.layers import LoRAMapping
from kvpilot.engine.worker.row_layout import RowLayout

NEW = GREEDY.max_tokens or 0


def _engine(base_dir, adapters, names, **flags) -> LLMEngine:
    args = EngineArgs(model=str(base_dir), device="cpu", enable_lora=True,
                      lora_modules=[f"{n}={adapters[n]}" for n in names], **flags)
    return LLMEngine.from_engine_args(args)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


def _run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]
             ) -> tuple[dict[str, list[int]], set[int]]:
    """Runs every request together; gives their tokens and the step sizes in adapters."""
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, GREEDY, lora_name=lora)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    mixes: set[int] = set()
    for _ in range(300):  # bounded
        if not engine.has_unfinished_requests():
            break
        running = {s.request.lora_name for s in engine.scheduler.running}
        mixes.add(len(running))
        for out in engine.step():
            tokens[out.request_id] += out.completions[0].token_ids
    assert not engine.has_unfinished_requests()
    return tokens, mixes


@pytest.mark.parametrize("name", ["attn", "mlp", "all", "qv"])
def test_adapter_matches_hf_peft(base_dir, adapters, name):
    engine = _engine(base_dir, adapters, [name])
    prompt = _prompt(1, 21)
    want = hf_greedy(base_dir, adapters[name], prompt, NEW)
    assert want != hf_greedy(base_dir, None, prompt, NEW)  # the adapter changes the output
    got, _ = run(engine, "r", prompt)  # the base model first: same engine, no adapter
    assert got == hf_greedy(base_dir, None, prompt, NEW)
    engine.add_request("a", prompt, GREEDY, lora_name=name)
    tokens: list[int] = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens += out.completions[0].token_ids
    assert tokens == want


@pytest.mark.parametrize("rows", [False, True])
def test_mixed_batch_equals_each_alone(base_dir, adapters, rows):
    # rows: the mixed engine runs its prompts as single-token rows (`engine.row_layout`, on
    # CUDA where a decode graph then replays the step), each row under its entry's adapter
    names = ["attn", "mlp", "all"]
    requests = {f"{lora}-{i}": (_prompt(10 * i + k, 5 + 9 * i + k), lora)
                for k, lora in enumerate([*names, None]) for i in range(2)}
    alone = {}
    for rid, (prompt, lora) in requests.items():
        engine = _engine(base_dir, adapters, names, max_loras=3)
        alone[rid] = _run_all(engine, {rid: (prompt, lora)})[0][rid]
    mixed_engine = _engine(base_dir, adapters, names, max_loras=3)
    if rows:
        mixed_engine.rows = RowLayout(max_rows=256, max_extra_tokens=10**6)
    mixed, mixes = _run_all(mixed_engine, requests)
    assert mixed == alone
    assert max(mixes) == 4  # a step ran the three adapters and the base together
    assert mixed_engine.lora is not None and mixed_engine.lora.num_loads == 3


def test_one_slot_serves_two_adapters_in_turn(base_dir, adapters):
    engine = _engine(base_dir, adapters, ["attn", "qv"], max_loras=1)
    requests = {f"{lora}-{i}": (_prompt(i, 7 + i), lora) for i in range(3)
                for lora in ("attn", "qv", None)}
    got, mixes = _run_all(engine, requests)
    assert max(mixes) <= 2  # one adapter (and the base) at a time
    for rid, (prompt, lora) in requests.items():
        assert got[rid] == hf_greedy(base_dir, adapters[lora] if lora else None, prompt, NEW)
    assert engine.lora is not None and engine.lora.num_loads >= 2


def test_prefix_cache_does_not_mix_base_and_adapter(base_dir, adapters):
    engine = _engine(base_dir, adapters, ["all"], block_size=4)
    prompt = _prompt(3, 30)
    run(engine, "base", prompt)
    hits = engine.kv.prefix_cache_hits
    engine.add_request("lora", prompt, GREEDY, lora_name="all")
    tokens: list[int] = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens += out.completions[0].token_ids
    assert engine.kv.prefix_cache_hits == hits  # the base model's blocks are not the adapter's
    assert tokens == hf_greedy(base_dir, adapters["all"], prompt, NEW)
    engine.add_request("lora-again", prompt, GREEDY, lora_name="all")
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert engine.kv.prefix_cache_hits > hits  # the adapter's own blocks are reused


def test_stats_name_running_and_waiting_adapters(base_dir, adapters):
    engine = _engine(base_dir, adapters, ["attn", "qv"], max_loras=1)
    engine.add_request("a", _prompt(1, 9), GREEDY, lora_name="attn")
    engine.add_request("q", _prompt(2, 9), GREEDY, lora_name="qv")
    engine.add_request("b", _prompt(3, 9), GREEDY)
    engine.step()  # one slot: attn runs, qv waits for it
    stats = engine.get_stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (
        1, ["attn"], ["qv"])
    assert stats.num_running == 2  # the base request runs beside the adapter


def test_triton_kernel_path_matches_hf_peft(base_dir, adapters, monkeypatch):
    # the CUDA path (tokens grouped on the device, one zeroed workspace per forward, shrink
    # splitting K with atomic adds: down_proj's K of 96 is two 64-wide slices) run by
    # Triton's interpreter on CPU, a base request beside the adapter's
    init = LoRAMapping.__init__

    def kernel_mapping(self: LoRAMapping, *args) -> None:
        init(self, *args)
        self.use_kernel = True

    monkeypatch.setattr(LoRAMapping, "__init__", kernel_mapping)
    engine = _engine(base_dir, adapters, ["all"])
    requests = {"all": (_prompt(3, 13), "all"), "base": (_prompt(4, 9), None)}
    tokens, mixes = _run_all(engine, requests)
    assert engine.lora is not None and engine.lora.model.mapping.workspace is not None
    assert max(mixes) == 2
    for rid, (prompt, lora) in requests.items():
        assert tokens[rid] == hf_greedy(base_dir, adapters[lora] if lora else None, prompt, NEW)
