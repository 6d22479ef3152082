"""How the engine's streaming processes run their event loop: uvloop, and a GC settled for it.

The API servers and the load generators (`kvpilot bench serve`, the benchmarks' clients)
each handle a few dozen short-lived objects per streamed token. Torch-free.
"""

from __future__ import annotations

import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# the cyclic GC's young generation, in tracked objects (CPython's default: 700)
GC_YOUNG_OBJECTS = 20_000


def settle_gc() -> None:
    """Readies the cyclic GC for streaming, once start-up is done.

    Every streamed token allocates a few dozen objects, nearly all freed by their
    reference counts. With CPython's default young generation (700) an API server's
    GC ran ~270 times in a few seconds of 256 streams and twice walked the whole
    heap, ~20 ms each, every stream's ITL at once. The start-up heap (FastAPI,
    pydantic, the tokenizer), frozen, is never walked again (vLLM's and SGLang's API
    servers do the same); a young generation of `GC_YOUNG_OBJECTS` keeps the older
    ones' ratios and left a few collections, no full one, in such a run: ITL
    p99/p50 1.80-1.83 against 2.71-5.08 (`bench/results/delivery_path-CPU-2026-11-27.md`).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_OBJECTS, older, oldest)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` on uvloop where it is installed (an engine dependency on Linux; vLLM's and
    SGLang's API servers use it too), else on asyncio's own loop; gives its result."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(main)
    return uvloop.run(main)
