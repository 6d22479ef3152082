"""A tiny LLMEngine stand-in with controlled timing (each step sleeps `step_delay`).

It is a `ServedEngine`: pyright checks it against the protocol (see the end of the file).
An engine core process builds it through `fake_engine` (picklable with
functools.partial, so the spawned process can import and call it).
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import EngineStats, RequestMetrics
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.outputs import CompletionDelta, EngineCoreOutput

if TYPE_CHECKING:
    from kvpilot.engine.core_process.entry import EngineBuilder
    from kvpilot.engine.engine_loop.engine_core import ServedEngine


class ByteTokenizer:
    """Bytes are tokens; 256 is end-of-sequence."""

    eos_token_id = 256
    vocab_size = 257
    max_token_chars = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class ModelConfig:
    max_model_len: int = 128
    vocab_size: int = 257


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    outs: list[list[int]] = field(default_factory=list)


class FakeEngine:
    """Generates 'a', 'b', 'c', ... one token per step per completion; the step numbered
    `fail_on_step` (from 1) raises instead; `break_after_s` seconds after the step numbered
    `break_on_step`, it reports a failure from another thread (as a TP executor does when a
    worker dies between steps) and steps on."""

    def __init__(self, step_delay: float = 0.0, num_blocks: int = 64,
                 fail_on_step: int | None = None, break_on_step: int | None = None,
                 break_after_s: float = 0.0) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_config = ModelConfig()
        self.engine_args = EngineArgs(model="fake")
        self.kv_events = KVEventLog()  # stays empty: no prefix cache here
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.fail_on_step = fail_on_step
        self.break_on_step = break_on_step
        self.break_after_s = break_after_s
        self.failure_callbacks: list[Callable[[str], None]] = []
        self.reqs: dict[str, _Req] = {}
        self.steps = 0
        self.generated = 0
        self.prompt_tokens = 0

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        if lora_name is not None:
            raise ValueError(f"model={lora_name!r} is not a loaded LoRA adapter: the fake "
                             "engine serves none")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) + (params.max_tokens or 0) > self.model_config.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens} is invalid: too long")
        self.reqs[request_id] = _Req(request_id, ids, params,
                                     RequestMetrics(arrival_time or time.monotonic()),
                                     [[] for _ in range(params.n)])

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[EngineCoreOutput]:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        if self.steps == self.break_on_step:
            for callback in self.failure_callbacks:
                timer = threading.Timer(self.break_after_s, callback,
                                        args=("fake worker rank 1 was killed by SIGKILL",))
                timer.daemon = True
                timer.start()
        time.sleep(self.step_delay)
        now = time.monotonic()
        outputs = []
        for req in list(self.reqs.values()):
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self.prompt_tokens += len(req.prompt)
            for toks in req.outs:
                toks.append(97 + len(toks) % 26)
                self.generated += 1
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
            done = len(req.outs[0]) >= (req.params.max_tokens or 16)
            if done:
                req.metrics.finished_time = now
                del self.reqs[req.rid]
            outputs.append(EngineCoreOutput(
                req.rid, [CompletionDelta(i, [t[-1]], finish_reason="length" if done else None)
                          for i, t in enumerate(req.outs)], done, metrics=req.metrics))
        return outputs

    def get_stats(self) -> EngineStats:
        used = min(self.num_blocks, len(self.reqs))
        return EngineStats(num_running=len(self.reqs), kv_cache_usage=used / self.num_blocks,
                           num_total_blocks=self.num_blocks,
                           num_free_blocks=self.num_blocks - used,
                           prompt_tokens=self.prompt_tokens, generation_tokens=self.generated)

    def step_timing(self) -> str:
        return "GPU wait 0.0 ms"  # it has none

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self.failure_callbacks.append(callback)

    def shutdown(self) -> None:
        pass


def fake_engine(engine_args: EngineArgs, host: str, http_port: int, step_delay: float = 0.0,
                fail_on_step: int | None = None, break_on_step: int | None = None,
                break_after_s: float = 0.0) -> FakeEngine:
    """Gives the engine a core process serves in the tests (an `entry.EngineBuilder`)."""
    return FakeEngine(step_delay, fail_on_step=fail_on_step, break_on_step=break_on_step,
                      break_after_s=break_after_s)


class GcNotingEngine(FakeEngine):
    """A FakeEngine that writes to `path`, at each step, how many objects its process froze
    out of the cyclic GC's walks."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def step(self) -> list[EngineCoreOutput]:
        Path(self.path).write_text(str(gc.get_freeze_count()))
        return super().step()


def fake_engine_noting_gc(engine_args: EngineArgs, host: str, http_port: int, path: str
                          ) -> FakeEngine:
    return GcNotingEngine(path)


def fake_engine_with_a_worker(engine_args: EngineArgs, host: str, http_port: int) -> FakeEngine:
    """Gives a FakeEngine after starting and joining a process of its own, as a tensor-parallel
    engine starts its workers (a daemonic core process could not)."""
    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.0,))
    worker.start()
    worker.join(60)
    if worker.exitcode != 0:
        raise RuntimeError(f"the worker process exited with {worker.exitcode}")
    return FakeEngine()


def fake_engine_signalled_off_the_main_thread(engine_args: EngineArgs, host: str,
                                              http_port: int) -> FakeEngine:
    """Gives a FakeEngine whose process gets a SIGTERM on another thread 2 s later: Linux
    may hand a process's signal to any thread (a gloo or torch thread of a parallel core)."""
    def signal_this_thread() -> None:
        time.sleep(2.0)  # the core is idle in its poll by then (if not, it exits all the same)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=signal_this_thread, name="fake-gloo", daemon=True).start()
    return FakeEngine()


def fake_engine_deaf_to_sigterm(engine_args: EngineArgs, host: str, http_port: int
                                ) -> FakeEngine:
    """Gives a FakeEngine whose process never takes SIGTERM (blocked), as a core stuck where
    its handler cannot run."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    return FakeEngine()


if TYPE_CHECKING:  # FakeEngine stands in for LLMEngine wherever a core serves one
    _: ServedEngine = FakeEngine()
    _builder: EngineBuilder = fake_engine
