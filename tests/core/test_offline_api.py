"""The offline `LLM` used as vLLM's docs use it: options as keywords (structured ones as
dicts or config objects), `generate` with `use_tqdm`, prompt dicts, `chat`; what it cannot
take is refused naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.checkpoints import write_checkpoint

from kvpilot.engine.contracts.speculative import SpeculativeConfig
from kvpilot.engine.entrypoints.llm import LLM, SamplingParams
from kvpilot.engine.entrypoints.offline_args import engine_args_of

TINY = {"num_kv_blocks": 64, "max_model_len": 256}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-llama", **TINY)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF Llama checkpoint written by transformers (from_config + save_pretrained)."""
    return write_checkpoint(tmp_path_factory.mktemp("offline-api"), "llama", seed=3)


def test_generate_as_in_vllms_quickstart(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["Hello, my name is", "The president of the United States is",
               "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    assert [output.prompt for output in outputs] == prompts
    for output in outputs:
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and len(output.outputs[0].token_ids) == 16
    assert "Processed prompts" in capsys.readouterr().err  # use_tqdm=True, vLLM's default


def test_use_tqdm_false_draws_nothing_and_a_class_draws_the_bar(
        llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(["a", "b"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    bars: list[FakeBar] = []

    class FakeBar:
        def __init__(self, total: int, **kwargs: object) -> None:
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            self.closed = True

    llm.generate(["a", "b", "c"], params, use_tqdm=FakeBar)
    assert [(b.total, b.n, b.closed) for b in bars] == [(3, 3, True)]


def test_prompt_dicts_are_vllms_text_and_tokens_prompts(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The capital of France is")
    by_text, by_ids, plain = llm.generate(
        [{"prompt": "The capital of France is"}, {"prompt_token_ids": ids},
         "The capital of France is"], greedy, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids \
        == plain.outputs[0].token_ids
    assert by_ids.prompt_token_ids == ids


def test_chat_as_in_vllms_docs(llm: LLM) -> None:
    sampling_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 6
    # the prompt is the chat template's rendering, as the server's chat endpoint makes it
    text = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    assert outputs[0].prompt_token_ids == llm.get_tokenizer().encode(
        text, add_special_tokens=False)
    batch = llm.chat([conversation for _ in range(3)], sampling_params=sampling_params,
                     use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [outputs[0].outputs[0].token_ids] * 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo"}]}]
    (joined,) = llm.chat(parts, sampling_params, use_tqdm=False)
    (whole,) = llm.chat([{"role": "user", "content": "Hello"}], sampling_params, use_tqdm=False)
    assert joined.prompt_token_ids == whole.prompt_token_ids


def test_chat_continues_the_final_message_and_takes_a_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conversation = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "The answer is"}]
    (out,) = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True)
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("The answer is")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (out,) = llm.chat(conversation[:1], params, use_tqdm=False, chat_template=template)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[user] Hi\n"


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                      use_tqdm=False), "messages[0].content has a 'image_url' part"),
    (lambda m: m.chat([{"content": "hi"}], use_tqdm=False), "messages[0]="),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], use_tqdm=False,
                      continue_final_message=True), "add_generation_prompt=True and "
                                                    "continue_final_message=True contradict"),
    (lambda m: m.generate([{"prompt": "hi", "multi_modal_data": {}}], use_tqdm=False),
     "prompts[0] key 'multi_modal_data' is not supported"),
    (lambda m: m.generate(["hi"], use_tqdm="yes"), "use_tqdm='yes' is invalid"),
    (lambda m: m.generate(["hi", [5, 99999]], use_tqdm=False), "prompt token ids must be in"),
])
def test_calls_it_cannot_take_are_refused_naming_the_key(llm: LLM, call, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(("options", "message"), [
    ({"max_num_seq": 8}, "LLM(..., max_num_seq=...) is not an option of kvpilot's engine: "
                         "did you mean max_num_seqs?"),
    ({"trust_remote_code": True}, "LLM(..., trust_remote_code=...) is not an option"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                             "draft_tensor_parallel_size": 1}},
     "speculative_config key 'draft_tensor_parallel_size' is not supported"),
    ({"speculative_config": {"method": "eagle", "num_speculative_tokens": 4}},
     "speculative_config method='eagle' is not supported"),
    ({"speculative_config": SpeculativeConfig("ngram", 0, 4, 2)},
     "num_speculative_tokens=0 is invalid"),
    ({"speculative_config": 4}, "speculative_config=4 is invalid"),
    ({"lora_modules": {"sql": 3}}, "lora_modules {'sql': 3} is invalid"),
])
def test_options_it_cannot_take_are_refused_naming_the_key(options, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engine_args_of("tiny-llama", options)


def test_structured_options_become_the_flags_workers_start_with() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    by_dict = engine_args_of("tiny-llama", {"speculative_config": spec})
    by_object = engine_args_of("tiny-llama", {"speculative_config": SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)})
    by_text = engine_args_of("tiny-llama", {"speculative_config": '{"method": "ngram", '
                                                                  '"num_speculative_tokens": 4}'})
    assert by_dict.speculative_config == by_object.speculative_config \
        == by_text.speculative_config
    cli = by_dict.to_cli()
    assert cli[cli.index("--speculative-config") + 1] == by_text.speculative_config
    lora = engine_args_of("tiny-llama", {"enable_lora": True, "lora_modules": {"sql": "/a/sql"}})
    assert lora.lora_modules == ["sql=/a/sql"]
    assert engine_args_of("tiny-llama", {"kv_cache_memory": 2**20}).kv_cache_memory == "1048576"


def test_speculative_config_dict_keeps_greedy_tokens_on_an_hf_checkpoint(checkpoint: Path) -> None:
    # as vLLM's speculative-decoding docs write it
    prompts = ["The future of AI is", "a b c a b c a b c a b", "1 2 3 4 1 2 3 4 1 2"]
    sampling_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(checkpoint), num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sampling_params)]
    llm = LLM(model=str(checkpoint), num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    outputs = llm.generate(prompts, sampling_params)
    stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.spec_decode_num_draft_tokens > 0  # it did speculate
