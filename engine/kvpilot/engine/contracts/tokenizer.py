"""What the server, the detokenizer and the router ask of a tokenizer (torch-free).

`kvpilot.engine.tokenizer.Tokenizer` is the engine's; test fakes and the router's
optional `--tokenizer` meet the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TokenizerLike(Protocol):
    """Encodes text, decodes token ids and renders chats through the model's template."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Gives the token ids of `text` (with BOS where the model's files ask for it)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Gives the text of `ids`."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Gives the prompt text of `messages` (raises ValueError or a template error)."""
        ...
