"""Trains the bundled tiny byte-level BPE tokenizer (run once; the outputs are committed).

    .venv/bin/python engine/torch_free/kvpilot/engine/contracts/assets/make_tiny_tokenizer.py

The corpus is the docstrings and comments of Python's own standard library plus a
few lines of non-Latin text, so the merges look like English and code while the
byte-level alphabet still encodes any UTF-8 string. Re-running on another Python
version gives slightly different merges; the committed files are the reference.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).parent
VOCAB_SIZE = 1024
SPECIAL = ["<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EXTRA_TEXT = [
    "Grüße aus Köln. Ça va? ¿Qué tal? Привет, мир! Γειά σου κόσμε.",
    "こんにちは世界。你好，世界。안녕하세요 세계. مرحبا بالعالم. שלום עולם.",
    "Emoji: 🙂 🚀 👩‍💻 — naïve café, résumé, 12°C, €5, ±3.",
]
# ChatML, the format Qwen uses; raise_exception guards unknown roles like HF templates do.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Gives the training texts: stdlib sources (first 2,000 files, sorted) plus EXTRA_TEXT."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts)[:2000]
    texts = [p.read_text(encoding="utf-8", errors="ignore") for p in files]
    return texts + EXTRA_TEXT * 50


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    # The post-processor adds BOS the way Llama's tokenizer.json does, so HF and kvpilot agree.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    tokenizer.save(str(HERE / "tiny-tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
