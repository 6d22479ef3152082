"""Median microseconds per call of work replayed from a CUDA graph (the decode case: launches
back to back, no host in between)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], calls: int, replays: int = 20) -> float:
    """Gives the median us per call of `fn`, which makes `calls` calls, captured in a graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    graph.reset()
    return sorted(times)[len(times) // 2]
