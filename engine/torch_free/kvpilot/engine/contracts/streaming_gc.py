"""The cyclic GC settled for a process that streams: the engine's API servers, the router
and the load generators each handle a few dozen short-lived objects per streamed token."""

from __future__ import annotations

import gc

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
