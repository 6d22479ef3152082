"""The engine tokenizer round-trips any UTF-8 text and agrees with HF AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from helpers.checkpoints import write_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.builtin_models import BOS_ID, ENDOFTEXT_ID, TINY_VOCAB_SIZE
from kvpilot.engine.contracts.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "",
    "  two leading spaces and a trailing one ",
    "Grüße, Привет 🙂 你好 👩‍💻 مرحبا",
    "def f(x):\n\treturn x ** 2\n",
    "<|im_start|>user\nhi<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Привет 🙂"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
]


@pytest.fixture(scope="module")
def tok_dir(tiny_checkpoints):
    """A checkpoint dir as written by `write_checkpoint` (tokenizer files copied in)."""
    return tiny_checkpoints("llama")


@pytest.fixture(scope="module")
def pair(tok_dir):
    from transformers import AutoTokenizer

    return load_tokenizer(tok_dir), AutoTokenizer.from_pretrained(tok_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_hf(pair, text, add_special_tokens):
    ours, hf = pair
    ids = ours.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(pair, messages, add_generation_prompt):
    ours, hf = pair
    expected = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_special_token_ids(pair):
    ours, _ = pair
    assert (ours.bos_token_id, ours.eos_token_id) == (BOS_ID, ENDOFTEXT_ID)
    assert ours.vocab_size == TINY_VOCAB_SIZE
    # every special added token, so decode(skip_special_tokens=True) drops exactly these
    assert ours.all_special_ids == [0, 1, 2, 3, 4]
    assert ours.encode("hi")[0] == BOS_ID
    assert BOS_ID not in ours.encode("hi", add_special_tokens=False)


def test_builtin_name_loads_bundled_tokenizer():
    tok = load_tokenizer("tiny-qwen3")
    assert tok.vocab_size == TINY_VOCAB_SIZE
    assert tok.decode(tok.encode("bundled ✓")) == "bundled ✓"


@given(st.text(max_size=60))
@settings(max_examples=60, deadline=None)
def test_any_text_round_trips(text):
    tok = load_tokenizer("tiny-llama")
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_unknown_role_raises_from_template(pair):
    ours, _ = pair
    with pytest.raises(Exception, match="role must be system, user or assistant"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])


@pytest.mark.parametrize(("post_processor", "add_bos_token", "expected_first"), [
    (True, True, BOS_ID),     # tokenizer.json adds BOS; not doubled
    (False, True, BOS_ID),    # only tokenizer_config.json asks for BOS
    (False, False, None),     # nobody asks: no BOS
])
def test_bos_follows_the_files(tmp_path, post_processor, add_bos_token, expected_first):
    write_tokenizer(tmp_path)
    tok_json = json.loads((tmp_path / "tokenizer.json").read_text())
    if not post_processor:
        tok_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok_json))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = load_tokenizer(tmp_path).encode("hi")
    assert ids.count(BOS_ID) == (expected_first is not None)
    assert (ids[0] == BOS_ID) == (expected_first is not None)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no chat_template in tokenizer_config\.json"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)


# A Llama-3-style template: bos_token, loop variables, tojson, a system-message default.
LLAMA3_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim }}"
    "{% if m.get('meta') %}{{ m['meta'] | tojson }}{% endif %}"
    "{% if not loop.last %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("messages", [
    *CHATS,
    [{"role": "user", "content": "  spaced  ", "meta": {"k": "ü", "n": [1, 2]}}],
])
def test_custom_template_with_special_tokens_matches_hf(tmp_path, messages):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3_STYLE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == expected


def test_chat_template_file_wins_over_config(tmp_path):
    """transformers 5 saves the template as chat_template.jinja; HF prefers that file."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_STYLE)
    messages = CHATS[1]
    hf = AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<|bos|>")  # LLAMA3_STYLE, not the config's ChatML
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == expected
