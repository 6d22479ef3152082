"""A request body's prompt as chained block hashes, the key of the prefix index.

With a tokenizer (`--tokenizer`) the hashes are exactly the engines' prefix-cache
hashes (same token ids, same `kvpilot.engine.contracts.block_hash`), so KV events the
engines publish line up with the router's own entries. Without one the router
hashes the prompt's UTF-8 bytes in blocks of `4 * block_size` bytes (about one
KV block of text): consistent across requests, which is all affinity needs.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any

from jinja2.exceptions import TemplateError

from kvpilot.engine.contracts.block_hash import UNSALTED, hash_prompt_blocks
from kvpilot.engine.contracts.tokenizer import TokenizerLike, check_unicode

BYTES_PER_TOKEN = 4
# The most of a prompt hashed (characters of text, or token ids): affinity is decided by a
# prompt's front, and a router reading a 16 MB prompt whole would spend seconds on it.
MAX_HASHED = 262_144
log = logging.getLogger("kvpilot.router")


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Gives the chat's messages as {"role", "content"} with text parts joined.

    The engine server renders exactly these (`ChatMessage.text()`) through the chat
    template, so with a tokenizer the router's hashes match the engines'.
    """
    out = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            raise ValueError(f"messages holds {type(message).__name__}, not an object")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": str(message.get("role", "")), "content": content or ""})
    return out


def prompt_text(body: dict[str, Any]) -> str | list[int]:
    """Gives the prompt of a completions or chat body: text, or token ids when given as ids."""
    if "messages" in body:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in chat_messages(body))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        prompt = prompt[0] if prompt else ""  # a batch: route by its first prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
    return str(prompt)


class PromptHasher:
    """Turns request bodies into block hashes, with or without the engines' tokenizer."""

    def __init__(self, block_size: int, tokenizer: TokenizerLike | None = None,
                 salt: bytes = UNSALTED) -> None:
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.salt = salt  # the fleet's, so the hashes equal the engines' (`FleetSecret`)
        self._encode: Callable[[dict[str, Any]], list[int]] = (
            self._encode_tokens if tokenizer is not None else self._encode_bytes)

    def hashes(self, body: dict[str, Any], parent_hash: int | None = None) -> list[int]:
        """Gives the chained hashes of the full blocks of the body's prompt, the first chained
        to `parent_hash` (a LoRA adapter's root, as the engines chain it); none for a prompt
        it cannot read (a lone surrogate, a malformed body): the engine answers that request
        with a 400 naming the field, and no prefix affinity is lost that it could have had.

        CPU work (a 1 MB prompt: seconds with a tokenizer): call it off the event loop.
        """
        size = self.block_size if self.tokenizer is not None else self.block_size * BYTES_PER_TOKEN
        try:
            return hash_prompt_blocks(self._encode(body), size, parent_hash, salt=self.salt)
        except (TypeError, ValueError, TemplateError, struct.error) as exc:  # ids beyond int32
            log.debug("prompt not hashed: %r", exc)
            return []

    def _encode_bytes(self, body: dict[str, Any]) -> list[int]:
        prompt = prompt_text(body)[:MAX_HASHED]
        return list(prompt) if isinstance(prompt, list) else list(check_unicode(prompt).encode())

    def _encode_tokens(self, body: dict[str, Any]) -> list[int]:
        tok = self.tokenizer
        assert tok is not None
        if "messages" in body:
            text = tok.apply_chat_template(chat_messages(body), add_generation_prompt=True)
            # The template writes any BOS itself (the engine server encodes it the same way).
            return list(tok.encode(text[:MAX_HASHED], add_special_tokens=False))
        prompt = prompt_text(body)[:MAX_HASHED]
        return prompt if isinstance(prompt, list) else list(tok.encode(prompt))
