"""vLLM's POST /tokenize and /detokenize: a prompt (text, or a chat through the template) to
token ids and back, with the model's own tokenizer, off the event loop. Like vLLM's, they
are outside /v1 (no API key): they tell nothing but the tokenizer."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.params import Limits, prompt_chars
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Text,
    TokenId,
)
from kvpilot.engine.server.serving import ServingContext


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest, ctx: ServingContext
              ) -> TokenizeResponse:
    limits: Limits = ctx.limits
    tokenizer = ctx.tokenizer
    if isinstance(request, TokenizeChatRequest):
        chat = ChatCompletionRequest(model=request.model or ctx.model_name,
                                     messages=request.messages)
        prompt_chars(chat, limits)
        messages: list[dict[str, Any]] = [{"role": m.role, "content": m.text()}
                                          for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt)
        except Exception as exc:  # a template may raise on role orders it does not allow
            raise bad_request(f"messages cannot be rendered by the chat template: {exc}",
                              "messages") from exc
    else:
        text = request.prompt
        prompt_chars(CompletionRequest(model=request.model or ctx.model_name, prompt=text),
                     limits)
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    strs = getattr(tokenizer, "convert_ids_to_tokens", None)
    return TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids,
                            token_strs=strs(ids) if request.return_token_strs and strs else None)


def add_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Adds POST /tokenize and POST /detokenize to the engine's app."""

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest
                       ) -> TokenizeResponse:
        return await ctx.off_loop(_tokenize, body, ctx)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        vocab = ctx.limits.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"tokens has token id {bad}, outside the vocabulary of {vocab}: "
                              f"send ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await ctx.off_loop(ctx.tokenizer.decode, body.tokens))
