"""An engine core stand-in for `delivery_path.py`: one token per running request every period.

`PacedEngine` is a `ServedEngine` that the real engine core process
(`core_process.proc.EngineCoreProc`) serves, so everything after the step (the
core's delivery, ZeroMQ, the API server's client, detokenisation, SSE, HTTP and
the load generator) is the real path, measured alone: the model costs nothing,
and the steps start on a fixed clock (`period_s` apart, never drifting; a late
step starts at once). Token ids walk the vocabulary, so the word-level
tokenizer decodes a different word each time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats, RequestMetrics
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.outputs import CompletionDelta, EngineCoreOutput


@dataclass(frozen=True)
class PacedModel:
    """What the API server checks requests against."""

    max_model_len: int
    vocab_size: int


@dataclass
class _Running:
    request_id: str
    max_tokens: int
    next_token: int
    metrics: RequestMetrics
    generated: int = 0


class PacedEngine:
    """Gives every running request one token per step; steps start `period_s` apart."""

    def __init__(self, engine_args: EngineArgs, period_s: float, vocab_size: int) -> None:
        self.engine_args = engine_args
        self.model_config = PacedModel(engine_args.max_model_len or 4096, vocab_size)
        self.kv_events = KVEventLog()  # no prefix cache
        self.tokenizer = load_tokenizer(engine_args.model)  # unused: the API server decodes
        self.period_s = period_s
        self._running: dict[str, _Running] = {}
        self._next_step = 0.0
        self._late_steps = 0
        self._steps = 0
        self._prompt_tokens = 0
        self._generated = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        if lora_name is not None:
            raise ValueError("the paced engine serves no LoRA adapters")
        if isinstance(prompt, str):
            raise ValueError("prompt must be token ids: the API server tokenises")
        self._prompt_tokens += len(prompt)
        start = sum(prompt) % self.model_config.vocab_size
        self._running[request_id] = _Running(request_id, params.max_tokens or 16, start,
                                             RequestMetrics(arrival_time or time.monotonic()))

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> list[EngineCoreOutput]:
        now = time.monotonic()
        if not self._steps or now - self._next_step > self.period_s:
            self._next_step = now  # the first step, or idle since: start the clock again
        elif self._next_step > now:
            time.sleep(self._next_step - now)
        else:
            self._late_steps += 1
        self._next_step += self.period_s
        self._steps += 1
        now = time.monotonic()
        outputs = []
        vocab = self.model_config.vocab_size
        for r in list(self._running.values()):
            token, r.next_token = r.next_token, (r.next_token * 31 + 7) % vocab
            r.generated += 1
            self._generated += 1
            m = r.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            done = r.generated >= r.max_tokens
            if done:
                m.finished_time = now
                del self._running[r.request_id]
            first_or_last = r.generated == 1 or done
            outputs.append(EngineCoreOutput(
                r.request_id, [CompletionDelta(0, [token], "length" if done else None)],
                done, metrics=m if first_or_last else None))
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), prompt_tokens=self._prompt_tokens,
                           generation_tokens=self._generated)

    def step_timing(self) -> str:
        return f"{self._late_steps} of {self._steps} steps started late"

    def on_failure(self, callback: Callable[[str], None]) -> None:
        pass  # nothing runs beside it that could break

    def shutdown(self) -> None:
        pass


def paced_engine(engine_args: EngineArgs, host: str, http_port: int, period_s: float = 0.01,
                 vocab_size: int = 32000) -> PacedEngine:
    """Gives the engine the core process serves (an `entry.EngineBuilder`; bind the period
    with functools.partial)."""
    return PacedEngine(engine_args, period_s, vocab_size)
