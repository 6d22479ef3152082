"""The offline API: `LLM(model).generate(prompts, params)` runs prompts to completion in-process.

Written as vLLM's offline API is: `LLM(model, **engine options)` (structured options as
dicts or config objects, `offline_args`), `generate(prompts, sampling_params, use_tqdm)`
with prompts as texts, token-id lists or `{"prompt": ...}` / `{"prompt_token_ids": ...}`
dicts, and `chat(messages, ...)` through the model's chat template (`offline_chat`).

The engine core runs in this process and thread, with no IPC: it gives only
finished requests' outputs, each whole, and their text is decoded once
(`request_state`). `kvpilot serve` runs the same core in its own process
(`core_process`) for the API servers.

An `LLM` owns what its engine started: a tensor- or pipeline-parallel engine's worker
processes and process groups, the grammar threads, the model and KV cache in device
memory. Leaving `with LLM(...) as llm:`, `llm.shutdown()`, or dropping the last reference
to it releases them all, so the next `LLM` in the same process (a notebook, a test
session, a sweep) starts from a clean slate.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvpilot.engine.contracts.outputs import EngineStats, RequestOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.engine_loop.request_state import RequestState
from kvpilot.engine.entrypoints.offline_args import engine_args_of
from kvpilot.engine.entrypoints.offline_chat import Conversation, chat_token_ids, conversations_of
from kvpilot.engine.structured.grammar import check_grammar

if TYPE_CHECKING:
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

__all__ = ["LLM", "SamplingParams"]

# text, its token ids, or vLLM's TextPrompt / TokensPrompt dicts
Prompt = str | list[int] | Mapping[str, Any]
Prompts = Prompt | Sequence[Prompt]
# use_tqdm: whether to show a progress bar, or the tqdm class (or a look-alike) to draw it
ProgressBar = bool | Callable[..., Any]


class LLM:
    """Runs an LLMEngine to completion over a list of prompts (tests, benchmarks, scripts)."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        from kvpilot.engine.engine_loop.llm_engine import LLMEngine

        self.engine_args = engine_args_of(model, engine_options)
        engine = LLMEngine.from_engine_args(self.engine_args)
        engine.stream_outputs = False  # only final outputs are read here
        # the engine lives in a holder the finalizer empties: once released, nothing here
        # keeps its tensors alive
        self._holder = _EngineHolder(engine)
        self._release = weakref.finalize(self, _release, self._holder)
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """Gives the engine; raises RuntimeError once this LLM is shut down."""
        engine = self._holder.engine
        if engine is None:
            raise RuntimeError("this LLM was shut down: create a new LLM(...) to generate again")
        return engine

    def shutdown(self) -> None:
        """Stops the engine's worker ranks, leaves its process groups, joins its threads and
        frees its memory (device memory too); the LLM is unusable afterwards. Idempotent;
        leaving a `with` block or dropping the last reference does the same."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> TokenizerLike:
        return self.engine.tokenizer

    def get_tokenizer(self) -> TokenizerLike:
        """Gives the model's tokenizer (vLLM's spelling of `tokenizer`)."""
        return self.tokenizer

    def generate(self, prompts: Prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: ProgressBar = True) -> list[RequestOutput]:
        """Gives one finished RequestOutput per prompt, in prompt order."""
        prompt_list = [_prompt_of(i, p) for i, p in enumerate(_as_list(prompts))]
        return self._generate(prompt_list, sampling_params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: ProgressBar = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Gives the assistant's reply to each conversation (one list of messages, or a list
        of them), rendered through the model's chat template or `chat_template`."""
        prompt_list: list[tuple[str | None, list[int] | None]] = [
            (None, chat_token_ids(self.tokenizer, conversation, chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, tools=tools,
                                  chat_template_kwargs=chat_template_kwargs))
            for conversation in conversations_of(messages)]
        return self._generate(prompt_list, sampling_params, use_tqdm)

    def _generate(self, prompt_list: list[tuple[str | None, list[int] | None]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: ProgressBar) -> list[RequestOutput]:
        """Runs (text, token ids) prompts to completion; a text without ids is encoded."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for "
                                 f"{len(prompt_list)} prompts: pass one per prompt or a single one")
        states: dict[str, RequestState] = {}
        for params in params_list:  # what the API server checks before the engine sees it
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params entry {params!r} is invalid: pass "
                                 "SamplingParams(...)")
            if params.structured_outputs is not None:
                check_grammar(params.structured_outputs)
        progress = _progress_bar(use_tqdm, len(prompt_list))
        try:
            for (text, ids), params in zip(prompt_list, params_list, strict=True):
                request_id = f"offline-{next(self._ids)}"
                token_ids = ids if ids is not None else self.tokenizer.encode(text or "")
                self.engine.add_request(request_id, token_ids, params)
                states[request_id] = RequestState(request_id, text, token_ids, params,
                                                  self.tokenizer, stream=False,
                                                  decode_each_token=False)
            return self._run(states, progress)
        except BaseException:
            # a refused prompt or an interrupt (Ctrl+C in a notebook) leaves no request
            # behind for the next call to find
            self._discard(list(states))
            raise
        finally:
            if progress is not None:
                progress.close()

    def beam_search(self, prompts: Prompts, params: SamplingParams) -> list[RequestOutput]:
        """Gives, per prompt, the beams sorted best first (outputs[0] is the best sequence)."""
        if params.beam_width < 2:
            raise ValueError(f"beam_width={params.beam_width} is invalid for beam_search: "
                             "pass SamplingParams(beam_width=2 or more)")
        return self.generate(prompts, params, use_tqdm=False)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def _run(self, states: dict[str, RequestState], progress: Any) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                output = states[delta.request_id].apply(delta)
                if output is not None:
                    done[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        return [done[i] for i in states]

    def _discard(self, request_ids: list[str]) -> None:
        """Aborts `request_ids` and drops their final outputs."""
        self.engine.abort_request(request_ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()


class _EngineHolder:
    """The one strong reference to an LLM's engine, cleared when the LLM is released."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine: LLMEngine | None = engine


def _release(holder: _EngineHolder) -> None:
    """Shuts the held engine down and frees what it held (run once, by `weakref.finalize`:
    on `shutdown()`, when the LLM is collected, or at interpreter exit)."""
    engine, holder.engine = holder.engine, None
    if engine is None:
        return
    try:
        engine.shutdown()
    finally:
        on_cuda = engine.runner.device.type == "cuda"
        del engine
        gc.collect()  # the engine's reference cycles hold its tensors until collected
        if on_cuda:
            import torch

            torch.cuda.empty_cache()


def _progress_bar(use_tqdm: ProgressBar, total: int) -> Any:
    """Gives the progress bar over `total` prompts that `use_tqdm` asks for, or None."""
    if use_tqdm is False or total == 0:
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        use_tqdm = tqdm
    if not callable(use_tqdm):
        raise ValueError(f"use_tqdm={use_tqdm!r} is invalid: pass True, False or a tqdm class")
    return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _as_list(prompts: Prompts) -> list[Prompt]:
    """Gives the prompts one by one: a lone text, token-id list or prompt dict is one prompt."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    token_ids = [p for p in prompts if isinstance(p, int)]
    others = [p for p in prompts if not isinstance(p, int)]
    if token_ids and others:
        raise ValueError("prompts mixes token ids with prompts: pass one list of token ids, "
                         "or a list of prompts (texts or token-id lists)")
    return [token_ids] if token_ids else others


def _prompt_of(index: int, prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """Gives (text, token ids) of one prompt; a dict is vLLM's {"prompt": text} or
    {"prompt_token_ids": ids}, and any other key is refused naming it."""
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, Mapping):
        return None, list(prompt)
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompts[{index}] key {unknown[0]!r} is not supported: give "
                         "{'prompt': text} or {'prompt_token_ids': [ids]}")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if ids is not None:
        if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompts[{index}] prompt_token_ids={ids!r} is invalid: give a "
                             "list of token ids")
        return (text if isinstance(text, str) else None), list(ids)
    if not isinstance(text, str):
        raise ValueError(f"prompts[{index}]={dict(prompt)!r} is invalid: give "
                         "{'prompt': text} or {'prompt_token_ids': [ids]}")
    return text, None
