"""LoRA flags, PEFT adapter dirs and the slot LRU: what is accepted, what is refused and
how the error names the flag or field, the value and the fix."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.lora import lora_root_hash, parse_lora_modules
from kvpilot.engine.lora.peft_adapter import load_peft_adapter
from kvpilot.engine.lora.slots import LoRASlots


@pytest.mark.parametrize(("flags", "error"), [
    (dict(lora_modules=["a=/x"]), r"lora_modules=\['a=/x'\] needs enable_lora: add --enable-lora"),
    (dict(enable_lora=True, lora_modules=["a"]), r"lora_modules item 'a' is invalid: write name=path"),
    (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "names adapter 'a' twice"),
    (dict(enable_lora=True, max_loras=0), r"max_loras=0 is invalid: must be at least 1"),
    (dict(enable_lora=True, max_lora_rank=0), r"max_lora_rank=0 is invalid"),
    (dict(enable_lora=True, tensor_parallel_size=2),
     r"enable_lora does not work with tensor_parallel_size x pipeline_parallel_size=2 yet: "
     "run on one GPU"),
    (dict(enable_lora=True, quantization="int8"),
     r"quantization='int8' yet: use --quantization none"),
    (dict(enable_lora=True, role="decode"), r"role='decode' yet: use --role both"),
    (dict(enable_lora=True, kv_offload_gb=1.0), r"kv_offload_gb=1.0 yet"),
    (dict(enable_lora=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'),
     r"speculative_config=.* yet: drop --speculative-config"),
])
def test_engine_args_refuse(flags, error):
    with pytest.raises(ValueError, match=error):
        EngineArgs(model="tiny-llama", **flags)


def test_engine_args_round_trip_the_lora_flags():
    args = EngineArgs(model="m", enable_lora=True, lora_modules=["a=/p", "b=/q"], max_loras=4)
    assert args.to_cli() == ["--model", "m", "--enable-lora", "--lora-modules", "a=/p", "b=/q",
                             "--max-loras", "4"]
    assert parse_lora_modules(args.lora_modules) == {"a": "/p", "b": "/q"}


def test_root_hash_separates_adapters_and_base():
    assert lora_root_hash(None) is None
    assert lora_root_hash("a") != lora_root_hash("b")
    assert lora_root_hash("a") == lora_root_hash("a")


def _edit_config(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize(("changes", "max_rank", "error"), [
    ({}, 4, r"r=8 exceeds max_lora_rank=4: start the engine with --max-lora-rank 8"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, 16,
     r"target_modules \['embed_tokens'\] are not supported"),
    ({"target_modules": "all-linear"}, 16, "is not a list of projections"),
    ({"use_dora": True}, 16, "use_dora=True is not supported: DoRA"),
    ({"bias": "all"}, 16, "bias='all' is not supported: use bias='none'"),
    ({"modules_to_save": ["lm_head"]}, 16, "modules_to_save"),
    ({"peft_type": "IA3"}, 16, "is not LoRA"),
])
def test_peft_adapter_refusals(adapters, tmp_path, changes, max_rank, error):
    path = _edit_config(adapters["attn"], tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=error):
        load_peft_adapter("edited", str(path), max_rank)


def test_peft_adapter_missing_dir_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"LoRA adapter 'x' at '.*nowhere': no adapter_config"):
        load_peft_adapter("x", str(tmp_path / "nowhere"), 16)


def test_peft_adapter_reads_rank_scale_and_every_projection(adapters):
    adapter = load_peft_adapter("all", str(adapters["all"]), 16)
    assert adapter.rank == 16 and adapter.scale == pytest.approx(16 / 16 ** 0.5)  # rsLoRA
    assert {proj for _, proj in adapter.weights} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert load_peft_adapter("mlp", str(adapters["mlp"]), 16).scale == 2.0  # alpha 8 / r 4


def test_slots_lru_never_evicts_an_adapter_in_use():
    slots = LoRASlots(2)
    assert slots.acquire("a", set()) == 0
    assert slots.acquire("b", set()) == 1
    assert slots.acquire("c", {"a", "b"}) is None  # both in use: c waits
    assert slots.acquire("a", set()) == 0  # a is now the most recently used
    assert slots.acquire("c", {"a"}) == 1  # b, least recently used and idle, gives way
    assert slots.resident == ["a", "c"]
    slots.release("a")
    assert slots.slot_of("a") is None and slots.acquire("d", {"c"}) == 0


def _start(model: str, modules: list[str]):
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(model=model, device="cpu", enable_lora=True,
                                                 lora_modules=modules))


def test_start_up_refuses_a_missing_adapter_dir(base_dir, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA adapter 'x' at '.*gone': no adapter_config"):
        _start(str(base_dir), [f"x={tmp_path / 'gone'}"])


def test_start_up_refuses_an_adapter_of_another_base(adapters, tmp_path):
    from helpers.checkpoints import write_checkpoint

    other = write_checkpoint(tmp_path, "qwen3")  # head_dim 32: q_proj is 128 rows, not 64
    with pytest.raises(ValueError, match=r"LoRA adapter 'attn': layer 0 \w_proj has A \(8, 64\) "
                                         r"and B \(\d+, 8\), this model needs \(8, 64\) and "
                                         r"\(\d+, 8\): use an adapter of this base model"):
        _start(str(other), [f"attn={adapters['attn']}"])


def test_start_up_refuses_mlp_adapters_on_experts(adapters):
    with pytest.raises(ValueError, match=r"adapts layer 0 \w+_proj, which this model has not "
                                         "as a dense projection"):
        _start("tiny-mixtral", [f"mlp={adapters['mlp']}"])


def test_an_adapter_may_not_take_the_base_models_name(base_dir, adapters):
    with pytest.raises(ValueError, match=r"lora_name='.*' is the base model's name: give the "
                                         "adapter another name"):
        _start(str(base_dir), [f"{base_dir}={adapters['attn']}"])


@given(st.integers(1, 4), st.lists(st.tuples(st.sampled_from("abcdef"),
                                             st.frozensets(st.sampled_from("abcdef"))),
                                   max_size=40))
def test_slots_invariants(max_loras, asks):
    """Whatever the asks: at most max_loras resident, each in its own slot, a granted adapter
    resident, and no adapter in use ever evicted."""
    slots = LoRASlots(max_loras)
    for name, in_use in asks:
        before = {n: slots.slot_of(n) for n in slots.resident}
        slot = slots.acquire(name, in_use)
        after = {n: slots.slot_of(n) for n in slots.resident}
        assert len(after) <= max_loras and len(set(after.values())) == len(after)
        assert all(0 <= s < max_loras for s in after.values() if s is not None)
        for kept in in_use & before.keys():
            assert after.get(kept) == before[kept]  # in use: never evicted nor moved
        if slot is None:
            assert after == before and len(before) == max_loras
        else:
            assert after[name] == slot


def test_the_warm_up_runs_an_adapter_loaded_at_start_up(base_dir, adapters):
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(base_dir), enable_lora=True, lora_modules=[f"attn={adapters['attn']}"],
        max_lora_rank=16, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64,
        warmup="on"))
    assert engine.paths.warm is not None and "lora" in engine.paths.warm
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3),
                       lora_name="attn")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.paths.cold == []
