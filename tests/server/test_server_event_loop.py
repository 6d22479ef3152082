"""The API server's runtime: uvicorn's httptools parser and uvloop (the engine's dependencies:
a quarter less API-server CPU per streamed token than h11 on asyncio's loop), and the cyclic
GC settled for streaming."""

from __future__ import annotations

import asyncio
import gc

import uvicorn
import uvloop
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpilot.engine.contracts.streaming_gc import GC_YOUNG_OBJECTS, settle_gc
from kvpilot.engine.entrypoints.event_loop import run_event_loop


def test_api_servers_run_on_uvloop() -> None:
    loops = []

    async def main() -> int:
        loops.append(type(asyncio.get_running_loop()))
        return 7

    assert run_event_loop(main()) == 7
    assert loops == [uvloop.Loop]


def test_uvicorn_parses_http_with_httptools() -> None:
    config = uvicorn.Config(FastAPI())
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol


def test_the_gc_is_settled_for_streaming() -> None:
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_threshold() == (GC_YOUNG_OBJECTS, before[1], before[2])
        assert gc.get_freeze_count() > 0  # the start-up heap is out of the GC's walks
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
