"""The model's tokenizer (torch-free): HF `tokenizer.json` through the `tokenizers` library
plus the chat template of `tokenizer_config.json`, with no `transformers` import; and
`TokenizerLike`, what the server, the detokenizer and the router ask of any tokenizer
(test fakes meet it too). The router's optional `--tokenizer` loads the same class, so
its prompt block hashes equal the engines'."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvpilot.engine.contracts.builtin_models import (
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    is_builtin,
)

# From this length on a text is encoded without holding the GIL (`encode_batch` of one; it
# costs ~1.5x on a 1 KB text, so short ones take plain `encode`): a server tokenising a
# long prompt in a worker thread keeps serving (its event loop needs the GIL), measured in
# tests/server/test_server_availability.py.
GIL_FREE_CHARS = 4096


class TokenizerLike(Protocol):
    """Encodes text, decodes token ids and renders chats through the model's template."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Gives the token ids of `text` (with BOS where the model's files ask for it)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Gives the text of `ids`."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Gives the prompt text of `messages` (raises ValueError or a template error);
        `extra` are more template variables (`tools`)."""
        ...

    @property
    def max_token_chars(self) -> int:
        """Gives the most characters of text one token covers (sizes the prompt limit)."""
        ...

class Tokenizer:
    """Encodes, decodes and renders chats the way HF's fast tokenizer does for the same files."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_template = _chat_template(config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.all_special_ids = sorted(
            {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            | {i for i in (self.bos_token_id, self.eos_token_id) if i is not None})
        self._add_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None
        self._max_token_chars: int | None = None

    @property
    def vocab_size(self) -> int:
        """Gives the number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """Gives the longest vocabulary string's length: no token covers more characters
        (a byte-level piece has one character per byte; added tokens included)."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1) or 1
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Gives the token ids of `text`; with special tokens, BOS leads when the files say so."""
        if len(text) < GIL_FREE_CHARS:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        else:  # `encode` holds the GIL throughout; `encode_batch` releases it
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        # tokenizer.json's post-processor usually adds BOS; add_bos_token covers files
        # whose post-processor does not (HF's Llama tokenizer does the same).
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Gives the text of `ids`, dropping special tokens unless asked to keep them."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Gives the vocabulary strings of `ids` (byte-level BPE pieces, not text); None for
        an id outside the vocabulary."""
        return [self._tok.id_to_token(i) for i in ids]

    def to_json(self) -> str:
        """Gives the tokenizer as tokenizer.json text (what the grammar library reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Gives the id of a vocabulary string, or None."""
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Gives the prompt text for `messages` rendered by the model's chat template."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat_template in tokenizer_config.json: use the completions "
                "API with a plain prompt, or add a chat_template to tokenizer_config.json")
        # HF hands every named special token of tokenizer_config.json to the template.
        specials = {key: _token_text(value) or "" for key, value in self.config.items()
                    if key.endswith("_token") and isinstance(value, str | dict)}
        context = {**specials, "messages": messages,
                   "add_generation_prompt": add_generation_prompt, **extra}
        return _compile(self.chat_template).render(**context)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

def check_unicode(text: str) -> str:
    """Gives `text` if it is valid Unicode; raises ValueError at its first lone surrogate.

    JSON may escape half a surrogate pair ("\\ud800"); Python decodes it into a str that
    UTF-8 cannot encode and the tokenizer refuses with a TypeError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"has a lone surrogate {text[exc.start]!r} at index {exc.start}, "
                         "which is not valid Unicode: send UTF-8 text (a surrogate only "
                         "in a high-low pair)") from exc
    return text

def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """Gives the tokenizer of a model dir or of a built-in tiny config name."""
    if is_builtin(str(path_or_name)):
        tok_file, config_file = TOKENIZER_FILE, TOKENIZER_CONFIG_FILE
    else:
        path = Path(path_or_name)
        tok_file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ValueError(
                f"tokenizer={str(path)!r} has no tokenizer.json: point --tokenizer (or --model) "
                "at an HF model directory that has one")
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template_file = config_file.parent / "chat_template.jinja"
    if template_file.is_file():
        # Newer checkpoints keep the template in its own file, which wins, as in HF.
        config["chat_template"] = template_file.read_text(encoding="utf-8")
    return Tokenizer(HFTokenizer.from_file(str(tok_file)), config)


def read_chat_template(value: str) -> str:
    """Gives the chat template `--chat-template` names: a file's text, else `value` itself as
    Jinja; raises ValueError naming the flag when it is neither."""
    path = Path(value)
    looks_like_template = "{" in value
    if not looks_like_template:
        if not path.is_file():
            raise ValueError(f"--chat-template={value!r} is neither a file nor a Jinja template "
                             "(no '{{' or '{%'): pass a path to a .jinja file or the template")
        value = path.read_text(encoding="utf-8")
    try:
        _compile(value)
    except TemplateError as exc:
        raise ValueError(f"--chat-template does not compile: {exc}") from exc
    return value


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """Gives the text of a special token written as a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token

def _chat_template(config: dict[str, Any]) -> str | None:
    """Gives the default chat template; some configs list several named ones."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template

def _raise_exception(message: str) -> None:
    raise TemplateError(message)

@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """Gives the compiled template in a sandbox with HF's helpers and whitespace settings."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
