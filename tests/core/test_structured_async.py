"""Structured outputs under async scheduling: the mask is computed while the forward runs.

A constrained request no longer forces synchronous steps: the engine reads the
previous step's tokens back after launching the forward, advances the matchers,
and fills the next mask then, on a background thread, while it books the
previous step and schedules the next. These tests force async scheduling on (CUDA's
default) on CPU, where the same code runs, and compare with synchronous steps,
where the mask is computed after the forward in place.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable

import jsonschema
import pytest
import torch
from core_helpers import Outputs

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.outputs import CompletionOutput
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.engine_loop.flights import AsyncFlights
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.structured.bitmask import BitmaskBuffer
from kvpilot.engine.structured.matchers import GrammarMatchers, MaskFill
from kvpilot.engine.worker.row_layout import RowLayout

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["a", "bc", "def"]}}}}


def _params(i: int) -> SamplingParams:
    constrained = i % 3 != 2  # every third request is plain, beside the constrained ones
    return SamplingParams(
        temperature=0 if i % 2 else 1.0, seed=i, max_tokens=80 if constrained else 12,
        ignore_eos=not constrained, structured_outputs=StructuredOutputsParams(
            json=json.dumps(SCHEMA)) if constrained else None)


def _drive(engine: LLMEngine, after_step: Callable[[int], None] = lambda _: None
           ) -> dict[str, CompletionOutput]:
    """Steps `engine` until its requests end (bounded), calling `after_step(step)` after each;
    gives each request's finished output."""
    outputs, done = Outputs(), {}
    for step in range(500):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            out = outputs.add(delta)
            if out.finished:
                done[out.request_id] = out.outputs[0]
        after_step(step)
    assert not engine.has_unfinished_requests()
    engine.shutdown()
    return done


def _engine(mode: str, max_num_seqs: int, request_ids: Iterable[int]) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", device="cpu", max_num_seqs=max_num_seqs, async_scheduling=mode))
    for i in request_ids:
        engine.add_request(str(i), [5 + i, 6, 7, 8], _params(i))
    return engine


def _gate_fills(monkeypatch: pytest.MonkeyPatch, timeout: float) -> tuple[threading.Semaphore,
                                                                          list[bool]]:
    """Makes each mask fill wait for a permit (up to `timeout` s); gives the permits and
    whether each fill got one in time."""
    permits, waited = threading.Semaphore(0), []
    fill = GrammarMatchers._fill

    def gated(self: GrammarMatchers, *args) -> None:
        waited.append(permits.acquire(timeout=timeout))
        fill(self, *args)

    monkeypatch.setattr(GrammarMatchers, "_fill", gated)
    return permits, waited


def _run(mode: str, rows: bool = False) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Gives each request's tokens and their text, and how many steps left a constrained row
    in flight (launched, not yet read back) when they returned; `rows`: prompts run as
    single-token rows (`engine.row_layout`, forced on: CPU captures no graphs)."""
    engine = _engine(mode, 8, range(9))
    if rows:
        engine.rows = RowLayout(max_rows=64, max_extra_tokens=10**6)
    constrained_in_flight = 0

    def count(_step: int) -> None:
        nonlocal constrained_in_flight
        flight = engine.flights.inflight
        if flight is not None and any(s.request.grammar is not None for s in flight.seqs):
            constrained_in_flight += 1

    done = _drive(engine, count)
    tokens = {k: list(v.token_ids) for k, v in done.items()}
    return tokens, {k: engine.tokenizer.decode(v) for k, v in tokens.items()}, \
        constrained_in_flight


@pytest.mark.parametrize("order", ["fill_first", "forward_first"])
def test_async_steps_keep_structured_requests_in_flight_and_match_sync_steps(
        monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    # fill_first: the previous forward is done (always on CPU), so the step takes the previous
    # tokens and starts its mask before its forward; forward_first: as when the GPU is busy
    if order == "forward_first":
        monkeypatch.setattr(AsyncFlights, "fill_first", lambda *_: None)
    sync_tokens, _, sync_flights = _run("off")
    async_tokens, async_texts, async_flights = _run("on")
    assert sync_flights == 0
    assert async_flights > 10  # constrained rows were sampled without a host wait
    # the mask computed ahead (async) allows what the mask computed in place (sync) allows
    assert async_tokens == sync_tokens
    for i in range(9):
        if _params(i).structured_outputs is not None:
            jsonschema.validate(json.loads(async_texts[str(i)]), SCHEMA)


def test_bitmask_buffer_rows_start_all_allowed_when_reused_and_grown() -> None:
    buffer = BitmaskBuffer(5, torch.device("cpu"))
    rows = buffer.rows(2)
    rows[1] = 0  # a constrained row of one step
    assert torch.equal(buffer.to_device(rows), rows)
    again = buffer.rows(3)  # the next step: more rows, none left over from the last
    assert again.shape == (3, 5) and bool((again == -1).all())
    again[2] = 7
    assert bool((buffer.rows(4) == -1).all())


def test_the_mask_fills_while_step_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    # each fill waits for a permit the test gives only once step() returned: a step that
    # waited for its own step's fill would hold it until the permit timed out
    permits, waited = _gate_fills(monkeypatch, timeout=5)
    engine = _engine("on", 4, [0])
    done = _drive(engine, lambda _: permits.release())
    assert len(waited) > 5 and all(waited)
    jsonschema.validate(json.loads(engine.tokenizer.decode(done["0"].token_ids)), SCHEMA)


def test_the_fill_starts_before_start_bitmask_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    # a thread waiting for the GIL gets it when the holder blocks or after the switch
    # interval (here 1 s): the fill must have begun when the engine goes on with its host
    # work, not start only once the engine waits for the mask
    began: list[float] = []
    returned: list[float] = []
    fill, start = GrammarMatchers._fill, GrammarMatchers.start_bitmask

    def timed_fill(self: GrammarMatchers, *args) -> None:
        began.append(time.perf_counter())
        fill(self, *args)

    def timed_start(self: GrammarMatchers, seqs: list) -> MaskFill | None:
        mask = start(self, seqs)
        if mask is not None and mask._filling is not None:
            returned.append(time.perf_counter())
        return mask

    monkeypatch.setattr(GrammarMatchers, "_fill", timed_fill)
    monkeypatch.setattr(GrammarMatchers, "start_bitmask", timed_start)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        done = _drive(_engine("on", 4, [0, 1]))
    finally:
        sys.setswitchinterval(interval)
    assert len(returned) > 5 and len(began) == len(returned)
    assert all(b < r for b, r in zip(began, returned, strict=True))
    assert set(done) == {"0", "1"}


def test_abort_while_the_mask_fills_leaves_the_others_valid(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    # a request aborted between steps, its row's mask still filling: the step in flight drops
    # its token, the others keep sampling from their own rows
    permits, waited = _gate_fills(monkeypatch, timeout=30)
    engine = _engine("on", 4, [0, 1, 3])  # constrained (see _params)

    def abort_once_filling(step: int) -> None:
        if step == 3:
            assert engine.flights.inflight is not None and engine.flights.inflight.tokens is None  # filling
            engine.abort_request(["1"])
        permits.release()

    done = _drive(engine, abort_once_filling)
    assert all(waited) and done["1"].finish_reason == "abort"
    for rid in ("0", "3"):
        jsonschema.validate(json.loads(engine.tokenizer.decode(done[rid].token_ids)), SCHEMA)


def test_structured_requests_give_the_same_tokens_when_prompts_run_as_rows() -> None:
    # the batch's prompts as single-token rows: the same logits rows reach the masked sampler
    sync_tokens, _, _ = _run("off")
    rows_tokens, rows_texts, rows_flights = _run("on", rows=True)
    assert rows_flights > 10
    assert rows_tokens == sync_tokens
    for i in range(9):
        if _params(i).structured_outputs is not None:
            jsonschema.validate(json.loads(rows_texts[str(i)]), SCHEMA)
