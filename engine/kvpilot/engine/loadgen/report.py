"""Benchmark report: pure functions from per-request timings to the summary and its table.

Keys and meaning follow `vllm bench serve` (times in milliseconds, throughput
per second) so results can be compared side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request measured (seconds); `success` is False when it failed."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """Gives the p-th percentile with linear interpolation (numpy's default method)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _std(values: list[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """Gives {metric: milliseconds} from `--goodput ttft:500 tpot:50` items."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput={item!r} is invalid: write NAME:MS with NAME one of "
                             f"{', '.join(SLO_METRICS)}, e.g. ttft:500")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput={item!r} is invalid: {value!r} is not a number of "
                             "milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"goodput={item!r} is invalid: the SLO must be > 0 ms")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Gives whether a successful request met every SLO (milliseconds)."""
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return result.success and all(measured[k] * 1000 <= v for k, v in slos.items())


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Gives the benchmark summary of `results` gathered over `duration` seconds."""
    ok = [r for r in results if r.success]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
    }
    if slos:
        summary["request_goodput"] = sum(meets_slos(r, slos) for r in ok) * per_s
        summary["goodput_slos_ms"] = dict(slos)
    for name in METRICS:
        values_ms = [v * 1000 for v in samples[name]]
        summary[f"mean_{name}_ms"] = sum(values_ms) / len(values_ms) if values_ms else 0.0
        summary[f"median_{name}_ms"] = percentile(values_ms, 50)
        summary[f"std_{name}_ms"] = _std(values_ms)
        for p in PERCENTILES:
            summary[f"p{p}_{name}_ms"] = percentile(values_ms, p)
    summary["errors"] = sorted({r.error for r in results if not r.success and r.error})[:10]
    return summary


_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def format_table(summary: dict[str, Any]) -> str:
    """Gives the summary as the fixed-width table `vllm bench serve` prints."""
    rows: list[str] = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{label:<44}{text:>16}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name in METRICS:
        rows.append("{s:{c}^60}".format(s=f" {_TITLES[name]} ", c="-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", summary[f"median_{name}_ms"])
        row(f"P99 {upper} (ms):", summary[f"p99_{name}_ms"])
    rows.append("=" * 60)
    return "\n".join(rows)
