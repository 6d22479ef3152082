"""Sends a dataset to an OpenAI-compatible server on a schedule and times every token.

Requests stream `/v1/completions` (or `/v1/chat/completions`, one user message)
with `stream_options.include_usage`, so token counts come from the server's own
tokenizer. Send times follow a gamma
process (burstiness 1 = Poisson) at `request_rate`, or all at once when the
rate is infinite; `max_concurrency` caps requests in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from kvpilot.engine.loadgen.datasets import SampleRequest
from kvpilot.engine.loadgen.report import RequestResult


@dataclass
class BenchConfig:
    """Where and how to send the load."""

    base_url: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    api_key: str | None = None
    timeout: float = 600.0
    seed: int = 0
    endpoint: str = "/v1/completions"


CHAT = "/v1/chat/completions"
# a streamed chunk's JSON: msgspec reads it several times faster than json.loads, and the
# load generator parses every token's chunk
decode_json = msgspec.json.Decoder(dict[str, Any]).decode


def send_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gives each request's send time (seconds after the start): gamma-distributed gaps.

    The gaps have mean 1/rate; burstiness is the gamma shape (1 = Poisson, lower =
    burstier, higher = more even), as `vllm bench serve` draws them.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate={rate}, burstiness={burstiness} are invalid: "
                         "both must be > 0 (use inf for no pacing)")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def _payload(cfg: BenchConfig, sample: SampleRequest) -> dict[str, object]:
    body: dict[str, object] = {"model": cfg.model, "max_tokens": sample.output_len,
                               "stream": True, "stream_options": {"include_usage": True},
                               "ignore_eos": cfg.ignore_eos}
    if cfg.endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    return body


def carries_tokens(chunk: dict[str, Any]) -> bool:
    """Gives whether a stream chunk brings output (text, or the finish), not only a role."""
    for choice in chunk.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get(
            "content")
        if text or choice.get("finish_reason"):
            return True
    return False


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Gives the stream's lines split on b"\n" only, as bytes.

    Servers write JSON with raw non-ASCII text, which may hold U+2028, U+0085 or
    \x1c: `str.splitlines` would cut a data line there; and a network read may end
    inside a multi-byte character, so lines are cut before any decoding.
    """
    buffer = b""
    async for data in chunks:
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r")
    if buffer:
        yield buffer


async def send_one(session: aiohttp.ClientSession, cfg: BenchConfig,
                   sample: SampleRequest) -> RequestResult:
    """Gives the timings of one streamed completion or chat (or why it failed)."""
    result = RequestResult(success=False)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(cfg.base_url + cfg.endpoint,
                                json=_payload(cfg, sample)) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {body[:200]}"
                return result
            async for line in sse_lines(resp.content.iter_any()):
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()  # as it arrived: parsing is this loop's own time
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = decode_json(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if carries_tokens(chunk):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.success = True
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(cfg: BenchConfig, samples: list[SampleRequest],
                        on_result: Callable[[RequestResult], None] | None = None,
                        ) -> tuple[list[RequestResult], float]:
    """Gives every request's result and the benchmark's wall-clock duration in seconds;
    `on_result` hears of each request as it ends (a progress bar)."""
    offsets = send_offsets(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(samples) or 1)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connections = aiohttp.TCPConnector(limit=cfg.max_concurrency or len(samples) or 1)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=cfg.timeout)
    async with aiohttp.ClientSession(headers=headers, connector=connections,
                                     timeout=timeout) as client:
        start = time.perf_counter()

        async def one(offset: float, sample: SampleRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:
                result = await send_one(client, cfg, sample)
            if on_result is not None:
                on_result(result)
            return result

        results = await asyncio.gather(*(one(o, s) for o, s in zip(offsets, samples,
                                                                     strict=True)))
        return list(results), time.perf_counter() - start
