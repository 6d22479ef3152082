"""CPU-bound handler work (parsing, planning, rendering) off kopf's event loop.

kopf runs every object's handlers as tasks of one asyncio loop, so a handler that renders
for a while holds up every other object. Rendering runs in a small thread pool instead:
at most RENDER_THREADS objects render at once, the loop keeps serving the rest, and what
one object may render is bounded before it starts (api.names.MAX_REPLICAS,
RenderConfig.max_pool_gpus).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

RENDER_THREADS = 2
_P = ParamSpec("_P")
_T = TypeVar("_T")
_pool = ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="kvpilot-render")


async def off_loop(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Gives fn(*args, **kwargs), computed in the render threads; exceptions propagate."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))
