"""Runs a bench function in a fresh process, which then exits.

A benchmark gives each engine configuration its own process, so the last one's GPU memory
and state are gone. A GPU run starts each in a new interpreter (`spawn`): nothing of CUDA's
state can come through a fork. A CPU smoke run (`reuse_imports`) forks each from one
forkserver that imported torch and the engine once: those imports are most of a tiny CPU
configuration's time.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PRELOAD = ["torch", "kvpilot.engine.engine_loop.llm_engine"]


class ChildFailed(RuntimeError):
    """The function raised in its process (the message holds its traceback), or the process
    died or ran out of time before it answered."""


def call_in_fresh_process(function: Callable[..., Any], *args: Any, reuse_imports: bool,
                          timeout: float | None = None) -> Any:
    """Gives `function(*args)` computed in a new process (forked from the forkserver when
    `reuse_imports`, else spawned); raises ChildFailed when it raised, died or took more
    than `timeout` s."""
    if reuse_imports:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
    else:
        context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_call, args=(writer, function, *args))
    process.start()
    writer.close()
    try:
        if not reader.poll(timeout):
            process.kill()
            raise ChildFailed(f"{function.__name__} gave no answer in {timeout:g}s")
        ok, value = reader.recv()
    except EOFError:
        ok, value = False, "the process died before it answered"
    finally:
        process.join()
    if not ok:
        raise ChildFailed(f"{function.__name__} failed (exit code {process.exitcode}):\n{value}")
    return value


def _call(pipe: Connection, function: Callable[..., Any], *args: Any) -> None:
    try:
        value = function(*args)
    except BaseException:
        pipe.send((False, traceback.format_exc()))
        raise
    pipe.send((True, value))
