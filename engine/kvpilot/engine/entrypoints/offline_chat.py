"""The token ids of an offline `LLM.chat` conversation, rendered as vLLM's `LLM.chat` renders it.

A conversation is OpenAI's list of messages (`{"role": ..., "content": ...}`, content a
string or a list of text parts); it goes through the model's chat template (or the one
given), and `continue_final_message` leaves the last message open for the model to go on,
as HF's `apply_chat_template` does. Torch-free.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.engine.contracts.tokenizer import Tokenizer, TokenizerLike, read_chat_template

Conversation = Sequence[Mapping[str, Any]]


def conversations_of(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """Gives the conversations `LLM.chat` was given: one list of messages, or a list of them."""
    if not messages:
        raise ValueError("messages=[] is invalid: give a list of {'role', 'content'} messages, "
                         "or a list of such lists")
    if all(isinstance(m, Mapping) for m in messages):
        return [messages]  # type: ignore[list-item]  # one conversation
    if all(isinstance(c, Sequence) and not isinstance(c, str) for c in messages):
        return list(messages)  # type: ignore[arg-type]  # a batch of conversations
    raise ValueError("messages mixes messages with conversations: give one list of "
                     "{'role', 'content'} messages, or a list of such lists")


def chat_token_ids(tokenizer: TokenizerLike, conversation: Conversation, *,
                   chat_template: str | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False,
                   tools: list[dict[str, Any]] | None = None,
                   chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Gives the prompt token ids of one conversation rendered through the chat template."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt=True and continue_final_message=True contradict "
                         "each other: pass add_generation_prompt=False to continue the last "
                         "message")
    messages = [_template_message(i, m) for i, m in enumerate(conversation)]
    if not messages:
        raise ValueError("a conversation is empty: give at least one message")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError(f"continue_final_message=True needs an assistant message last, not "
                         f"{messages[-1]['role']!r}: end the conversation with the reply to "
                         "continue")
    if chat_template is not None:
        tokenizer = _with_template(tokenizer, chat_template)
    extra = dict(chat_template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         **extra)
    if continue_final_message:  # cut what the template writes after the last message (HF's way)
        final = messages[-1]["content"]
        at = text.rfind(final.strip())
        if final.strip() and at < 0:
            raise ValueError("continue_final_message=True: the chat template does not write "
                             "the last message's content as given, so it cannot be continued")
        if final.strip():
            text = text[:at + len(final.strip())]
    # the template writes any BOS itself; adding special tokens again would double it
    return tokenizer.encode(text, add_special_tokens=False)


def _template_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """Gives one message as templates read it: content as one string (text parts joined)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}]={message!r} is invalid: each message is a dict "
                         "with a 'role' and a 'content'")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"messages[{index}].content has a {kind!r} part: kvpilot "
                                 "serves text models, give text parts only")
            texts.append(str(part.get("text", "")))
        out["content"] = "".join(texts)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise ValueError(f"messages[{index}].content={content!r} is invalid: give a string or "
                         "a list of {'type': 'text', 'text': ...} parts")
    return out


def _with_template(tokenizer: TokenizerLike, chat_template: str) -> TokenizerLike:
    """Gives a copy of `tokenizer` that renders chats with `chat_template` (text or a file)."""
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError("chat_template= needs the model's own tokenizer (tokenizer.json)")
    renamed = copy.copy(tokenizer)
    renamed.chat_template = read_chat_template(chat_template)
    return renamed
