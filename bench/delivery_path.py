"""Issue 17's delivery path alone, on CPU: ITL and CPU per token behind a core that steps on a clock.

The real engine core process serves `paced_core.PacedEngine` (one token per
running request every `--period-ms`, no model), and the real API server
processes (`--api-server-count`, `serve_api`) stream to the real load
generator (`kvpilot bench serve`'s runner, in `--clients` processes, as
`serve_vs_offline.py` sends). A perfect delivery path gives every ITL equal to
the period; what it adds is the delivery path's own: the core's delivery,
ZeroMQ, decoding the deltas, detokenisation, SSE, HTTP, and the load
generator's parsing. Reported: ITL p50/p90/p99 and max, tokens per chunk (mean ITL over
mean TPOT: above 1 when the API server fell behind and merged deltas), output
tok/s, and the CPU microseconds per streamed token of the API servers, the core
and the load generators (psutil).

    python bench/delivery_path.py --out DIR [--streams 256 --tokens 200 --period-ms 10]
        [--api-server-count 1] [--clients 4] [--profile]

`--profile` writes each API server's cProfile stats (api-server-<pid>.prof) to `--out`.
Writes delivery_path.json to `--out`. `--smoke`: a few streams (tests/server/test_delivery_path.py).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import multiprocessing
import os
import platform
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from paced_core import paced_engine
from serve_vs_offline import load

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.core_process.launch import CoreHandle, CoreProcess
from kvpilot.engine.loadgen.datasets import SampleRequest
from kvpilot.engine.server.api_servers import ApiServerConfig, serve_api
from kvpilot.engine.server.cli import bind

VOCAB = 32000
PROMPT_TOKENS = 16


def tokenizer_dir(root: Path) -> Path:
    """Gives a model dir holding a word-level tokenizer ("t<id>" is token <id>), as
    bench/e2e_gpu.py's `model_dir` makes for the GPU runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tok.save(str(root / "tokenizer.json"))
    return root


def samples(streams: int, tokens: int) -> list[SampleRequest]:
    """Gives `streams` requests of PROMPT_TOKENS words, each asking for `tokens` tokens."""
    return [SampleRequest(" ".join(f"t{(s * 97 + i) % VOCAB}" for i in range(PROMPT_TOKENS)),
                          PROMPT_TOKENS, tokens) for s in range(streams)]


class GcPauses:
    """Records the pauses of Python's cyclic GC in this process (gc.callbacks): (when it
    started, time.monotonic; generation; seconds)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int, float]] = []
        self._since = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._since = time.monotonic()
        else:
            self.pauses.append((self._since, info["generation"], time.monotonic() - self._since))


def gc_summary(pauses: list[tuple[float, int, float]], start: float, end: float
               ) -> dict[str, float]:
    """Gives the count, the total and the longest pause (ms) of each generation, of the pauses
    that started between `start` and `end`."""
    out: dict[str, float] = {}
    for gen in (0, 1, 2):
        ms = [s * 1e3 for at, g, s in pauses if g == gen and start <= at <= end]
        out |= {f"gen{gen}_count": len(ms), f"gen{gen}_total_ms": sum(ms),
                f"gen{gen}_max_ms": max(ms, default=0.0)}
    return out


def _api_server(core: CoreHandle, config: ApiServerConfig, sock: socket.socket,
                profile_to: str | None, gc_to: str) -> None:
    """One API server process: `serve_api`, under cProfile when `profile_to` is a directory;
    writes its GC pauses to `gc_to`/gc-<pid>.json (the parent keeps those of the load)."""
    pauses = GcPauses()
    try:
        _serve(core, config, sock, profile_to)
    finally:
        Path(gc_to, f"gc-{os.getpid()}.json").write_text(json.dumps(pauses.pauses))


def _serve(core: CoreHandle, config: ApiServerConfig, sock: socket.socket,
           profile_to: str | None) -> None:
    if profile_to is None:
        serve_api(core, config, sock)
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        serve_api(core, config, sock)
    finally:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_to, f"api-server-{os.getpid()}.prof"))


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _wait_ready(base: str, servers: list[multiprocessing.process.BaseProcess]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(s.exitcode is not None for s in servers):
            raise RuntimeError("an API server process exited while starting: see its log")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API server at {base} was not ready within 120 s")


def measure(streams: int, tokens: int, period_s: float, api_servers: int, clients: int,
            profile_to: Path | None) -> dict[str, Any]:
    """Gives the delivery path's numbers for `streams` streams sent at once (see the module
    docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        engine_args = EngineArgs(model=str(tokenizer_dir(Path(tmp))),
                                 served_model_name="served", max_model_len=8192)
        server_args = ServerArgs(log_level="warning", max_queue_len=4 * streams,
                                 api_server_count=api_servers)
        config = ApiServerConfig(engine_args, server_args, HttpAuth())
        sock = bind("127.0.0.1", 0)
        host, port = sock.getsockname()[:2]
        build = functools.partial(paced_engine, period_s=period_s, vocab_size=VOCAB)
        core = CoreProcess.start(engine_args, host, port, "warning", build=build)
        context = multiprocessing.get_context("spawn")
        servers: list[multiprocessing.process.BaseProcess] = []
        try:
            handle = core.wait_ready(120)
            servers = [context.Process(target=_api_server, name=f"api-server-{i}", args=(
                handle, config, sock, str(profile_to) if profile_to else None, tmp))
                for i in range(api_servers)]
            for server in servers:
                server.start()
            base = f"http://{host}:{port}"
            _wait_ready(base, servers)
            load(base, samples(4, 8))  # warm-up
            server_pids = [s.pid for s in servers if s.pid is not None]
            assert core.pid is not None, "started"
            before = _cpu(server_pids), _cpu([core.pid])
            started = time.monotonic()
            summary = load(base, samples(streams, tokens), clients=clients)
            ended = time.monotonic()
            after = _cpu(server_pids), _cpu([core.pid])
        finally:
            for server in servers:
                if server.pid is not None and server.exitcode is None:
                    os.kill(server.pid, signal.SIGTERM)  # a drain: nothing is in flight
            for server in servers:
                server.join(30)
            core.stop()
            sock.close()
        gc_pauses = [gc_summary(json.loads(p.read_text()), started, ended)
                     for p in Path(tmp).glob("gc-*.json")]
    out_tokens = summary["total_output_tokens"]
    return {"streams": streams, "tokens": tokens, "period_ms": period_s * 1e3,
            "api_servers": api_servers, "clients": clients,
            "output_tok_s": summary["output_throughput"],
            "itl_p50_ms": summary["median_itl_ms"], "itl_p90_ms": summary["p90_itl_ms"],
            "itl_p99_ms": summary["p99_itl_ms"],
            "itl_p99_over_p50": summary["p99_itl_ms"] / max(summary["median_itl_ms"], 1e-9),
            "tokens_per_chunk": summary["mean_itl_ms"] / max(summary["mean_tpot_ms"], 1e-9),
            "ttft_mean_ms": summary["mean_ttft_ms"],
            "api_server_cpu_us_per_token": (after[0] - before[0]) / out_tokens * 1e6,
            "core_cpu_us_per_token": (after[1] - before[1]) / out_tokens * 1e6,
            "loadgen_cpu_us_per_token": summary["loadgen_cpu_us_per_token"],
            "api_server_gc": gc_pauses, "summary": summary}


def row(r: dict[str, Any]) -> str:
    """Gives one markdown table row of a `measure` result."""
    return (f"| {r['streams']} x {r['tokens']}, {r['period_ms']:g} ms, {r['api_servers']} API "
            f"server(s) | {r['output_tok_s']:.0f} | {r['itl_p50_ms']:.1f} | "
            f"{r['itl_p99_ms']:.1f} | {r['itl_p99_over_p50']:.2f} | {r['tokens_per_chunk']:.2f} | "
            f"{r['api_server_cpu_us_per_token']:.0f}, {r['core_cpu_us_per_token']:.0f}, "
            f"{r['loadgen_cpu_us_per_token']:.0f} | "
            + "; ".join(f"{g['gen0_count'] + g['gen1_count'] + g['gen2_count']}, "
                        f"{g['gen2_count']}, {max(g[f'gen{n}_max_ms'] for n in (0, 1, 2)):.1f}"
                        for g in r["api_server_gc"]) + " |")


HEADER = ("| streams x tokens, period, API servers | output tok/s | ITL p50 ms | ITL p99 ms | "
          "p99/p50 | tokens/chunk | CPU us/token: API servers, core, load generators | "
          "API server GC in the load: collections, full ones, longest ms |\n"
          "|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200, help="output tokens per stream")
    parser.add_argument("--period-ms", type=float, default=10.0, help="the core's step period")
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--clients", type=int, default=4, help="load generator processes")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the API servers (their stats go to --out)")
    parser.add_argument("--smoke", action="store_true", help="8 streams x 16 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.tokens, args.clients = 8, 16, 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args.streams, args.tokens, args.period_ms / 1e3, args.api_server_count,
                     args.clients, args.out if args.profile else None)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": f"CPU ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
              "smoke": args.smoke, **result}
    (args.out / "delivery_path.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['machine']}\n{HEADER}\n{row(record)}")


if __name__ == "__main__":
    main()
