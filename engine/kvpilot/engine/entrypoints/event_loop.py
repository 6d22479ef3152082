"""How the engine's streaming processes run their event loop: uvloop (their GC is settled by
`contracts.streaming_gc`, which the torch-free router shares). Torch-free.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` on uvloop where it is installed (an engine dependency on Linux; vLLM's and
    SGLang's API servers use it too), else on asyncio's own loop; gives its result."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(main)
    return uvloop.run(main)
