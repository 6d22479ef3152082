"""Issue 17's acceptance benchmark: served throughput and latency against offline, one run.

On one machine, each phase in a fresh process (so each has the whole GPU):
1. offline: the nano-vllm recipe (256 requests of random token ids, input and
   output lengths uniform in 100..1024, ignore_eos) through `LLM.generate` on a
   Qwen3-0.6B-shaped model with dummy weights;
2. served: the same requests through `kvpilot serve` (engine core process plus
   `--api-server-count` API servers) by the `kvpilot bench serve` runner,
   all sent at once (request rate inf), once per API server count asked for;
3. served at a Poisson rate of `--saturation` x the request rate that step 2 reached;
4. batch 1 on a Llama-3-8B-shaped model: ms per output token of the offline engine
   loop and of one streamed request through `kvpilot serve`.
Both sides get the same engine flags and warm-ups; the prompts reach the server as
words of a word-level tokenizer that maps "t<id>" to token id <id>, so it computes
the very same token ids. Each served run also reports the CPU time its API server
processes and its engine core process spent per output token (psutil): an API
server that needs 1e6 / (tok/s) microseconds or more per token is the limit,
and more of them (`--api-server-count`) should help. The same holds for the load
generator: one event loop costs about as much per token as an API server, so the
requests are sent by `--clients` processes (request i by client i mod N, each at
1/N of the rate: together the same Poisson process), and their CPU per token is
reported too. Writes serve_vs_offline.json and .md to `--out`.

    python bench/serve_vs_offline.py --out DIR [--api-server-counts 1,2] [--smoke]

`--smoke` runs a tiny CPU version of every phase (tests/server/test_serve_vs_offline_smoke.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
from cpu_smoke import one_thread_per_process
from fresh_process import call_in_fresh_process

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.streaming_gc import settle_gc
from kvpilot.engine.entrypoints.event_loop import run_event_loop
from kvpilot.engine.loadgen.datasets import SampleRequest
from kvpilot.engine.loadgen.report import RequestResult, summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False}
SMOKE = {"requests": 8, "lengths": (8, 24), "batch1_prompt": 8, "batch1_tokens": 12,
         "throughput_model": TINY, "batch1_model": TINY,
         "engine": {"max_model_len": 256, "max_num_seqs": 16, "num_kv_blocks": 64,
                    "device": "cpu"},
         "batch1_engine": {"max_model_len": 256, "max_num_seqs": 4, "num_kv_blocks": 32,
                           "device": "cpu"}}


def full_spec() -> dict[str, Any]:
    """Gives the GPU run's sizes: the nano-vllm recipe, bench/e2e_gpu.py's model shapes."""
    # the sibling script (bench/ is the running script's directory, so on sys.path); imported
    # here, not at the top, so the spawned load generators do not load torch
    from e2e_gpu import LLAMA3_8B, QWEN3_0_6B

    return {"requests": 256, "lengths": (100, 1024), "batch1_prompt": 128,
            "batch1_tokens": 256, "throughput_model": QWEN3_0_6B, "batch1_model": LLAMA3_8B,
            "engine": {"max_model_len": 4096, "max_num_seqs": 256,
                       "max_num_batched_tokens": 16384},
            "batch1_engine": {"max_model_len": 2048, "max_num_seqs": 4}}


def recipe(num: int, low: int, high: int, vocab: int, seed: int = 0
           ) -> tuple[list[list[int]], list[int]]:
    """Gives the nano-vllm recipe's prompts (random ids) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(low, high))]
               for _ in range(num)]
    return prompts, [rng.randint(low, high) for _ in range(num)]


def as_samples(prompts: list[list[int]], out_lens: list[int]) -> list[SampleRequest]:
    """Gives the requests as the load generator sends them: one word per token id."""
    return [SampleRequest(" ".join(f"t{i}" for i in ids), len(ids), n)
            for ids, n in zip(prompts, out_lens, strict=True)]


def _call(pipe: Any, function: Callable[..., Any], *args: Any) -> None:
    pipe.send(function(*args))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def offline_throughput(path: str, flags: dict[str, Any], prompts: list[list[int]],
                       out_lens: list[int]) -> dict[str, Any]:
    """Gives offline `LLM.generate`'s output tokens/s on the recipe (after a warm-up)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    llm = LLM(path, load_format="dummy", **flags)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up, as nano-vllm does
    params = [SamplingParams(ignore_eos=True, max_tokens=n) for n in out_lens]
    _sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": sum(len(p) for p in prompts), "output_tokens": tokens,
            "elapsed_s": elapsed, "output_tok_s": tokens / elapsed,
            "async_scheduling": llm.engine.async_scheduling}


def offline_batch1(path: str, flags: dict[str, Any], prompt_len: int, new_tokens: int
                   ) -> dict[str, Any]:
    """Gives the offline engine loop's ms per output token for one request (after the first
    token, after a warm-up request)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=path, load_format="dummy", **flags))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    rng = random.Random(1)
    elapsed = 0.0
    for run in ("warm-up", "timed"):
        engine.add_request(run, [rng.randint(0, 500) for _ in range(prompt_len)], params)
        engine.step()  # the prefill and the first token
        _sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
        elapsed = time.perf_counter() - start
    return {"ms_per_token": elapsed / (new_tokens - 1) * 1e3, "new_tokens": new_tokens}


@contextmanager
def kvpilot_serve(path: str, flags: dict[str, Any], api_servers: int, log: Path
                  ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Runs `kvpilot serve` on a free port until the block exits; gives its base URL and
    process."""
    args = EngineArgs(model=path, load_format="dummy", **flags).to_cli()
    command = [sys.executable, "-m", "kvpilot.cli", "serve", *args, "--port", "0",
               "--log-level", "warning", "--api-server-count", str(api_servers)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield _wait_ready(proc, log), proc
    finally:
        proc.terminate()
        proc.wait(120)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if found:
            try:
                if httpx.get(f"{found.group(1)}/ready", timeout=2).status_code == 200:
                    return found.group(1)
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot serve exited:\n{log.read_text()}")
        time.sleep(0.2)
    raise RuntimeError(f"kvpilot serve did not become ready:\n{log.read_text()}")


def cpu_seconds(serve: subprocess.Popen[bytes]) -> dict[str, float]:
    """Gives the CPU seconds so far of `kvpilot serve`'s API server processes and of its
    engine core (its first spawned child; with one API server, `kvpilot serve` itself
    serves; multiprocessing's resource tracker is not counted)."""
    def used(p: psutil.Process) -> float:
        times = p.cpu_times()
        return times.user + times.system

    top = psutil.Process(serve.pid)
    spawned = [p for p in top.children() if "spawn_main" in " ".join(p.cmdline())]
    core, *api_servers = sorted(spawned, key=lambda p: p.create_time())
    return {"api_servers": sum(used(p) for p in api_servers or [top]), "core": used(core)}


def _client(base: str, samples: list[SampleRequest], rate: float, seed: int, start: Any
            ) -> tuple[list[RequestResult], float, float]:
    """One load generator's share, sent once every client is ready (`start`, a Barrier);
    gives (results, seconds, CPU seconds it spent)."""
    cfg = BenchConfig(base_url=base, model="served", request_rate=rate, ignore_eos=True,
                      seed=seed)
    settle_gc()  # as `kvpilot bench serve` does: a GC pause would be timed as the server's
    start.wait()
    cpu = time.process_time()
    results, duration = run_event_loop(run_benchmark(cfg, samples))
    return results, duration, time.process_time() - cpu


def itl_tail(results: list[RequestResult], p50: float) -> dict[str, float]:
    """Says where the ITLs over 2x the median come from: the share of all ITLs they are, the
    part of them that ended before the run's last first token (at rate inf: while the burst's
    prompts were still being prefilled, every request started at ~0), and the share of output
    tokens that arrived in a chunk with another (a chunk's ITL spans its tokens)."""
    itls = [x for r in results for x in r.itl]
    prefill_end = max(r.ttft for r in results)
    slow = early = 0
    for r in results:
        at = r.ttft
        for x in r.itl:
            at += x
            if x > 2 * p50:
                slow += 1
                early += at <= prefill_end
    tokens = sum(r.output_tokens for r in results)
    chunks = sum(len(r.itl) + 1 for r in results)
    return {"over_2x_p50": slow / max(len(itls), 1),
            "over_2x_p50_in_prefill_phase": early / max(slow, 1),
            "tokens_sharing_a_chunk": 1 - chunks / max(tokens, 1)}


def load(base: str, samples: list[SampleRequest], rate: float = math.inf, clients: int = 1,
         serve: subprocess.Popen[bytes] | None = None) -> dict[str, Any]:
    """Gives the `kvpilot bench serve` summary of `samples` sent at `rate` requests/s by
    `clients` processes, with the CPU time per output token of `serve`'s processes (when
    given) and of the clients."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(clients)
    parts = []
    for i in range(clients):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_call, args=(
            writer, _client, base, samples[i::clients], rate / clients, i, start))
        process.start()
        writer.close()
        parts.append((process, reader))
    before = cpu_seconds(serve) if serve else {}
    done = [reader.recv() for _, reader in parts]
    for process, _ in parts:
        process.join()
    results = [r for results, _, _ in done for r in results]
    summary = summarize(results, max(duration for _, duration, _ in done))
    summary["itl_tail"] = itl_tail(results, summary["median_itl_ms"] / 1e3)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    tokens = summary["total_output_tokens"]
    summary["loadgen_cpu_us_per_token"] = sum(cpu for _, _, cpu in done) / tokens * 1e6
    if serve:
        after = cpu_seconds(serve)
        for name, at_start in before.items():
            summary[f"{name}_cpu_us_per_token"] = (after[name] - at_start) / tokens * 1e6
    return summary


def served_row(summary: dict[str, Any], offline_tok_s: float) -> dict[str, Any]:
    return {"output_tok_s": summary["output_throughput"],
            "ratio_to_offline": summary["output_throughput"] / offline_tok_s,
            "request_rate_reached": summary["request_throughput"],
            "itl_p50_ms": summary["median_itl_ms"], "itl_p99_ms": summary["p99_itl_ms"],
            "itl_p99_over_p50": summary["p99_itl_ms"] / max(summary["median_itl_ms"], 1e-9),
            "ttft_mean_ms": summary["mean_ttft_ms"], "duration_s": summary["duration"],
            "api_server_cpu_us_per_token": summary["api_servers_cpu_us_per_token"],
            "core_cpu_us_per_token": summary["core_cpu_us_per_token"],
            "loadgen_cpu_us_per_token": summary["loadgen_cpu_us_per_token"],
            "itl_tail": summary["itl_tail"], "summary": summary}


def run(spec: dict[str, Any], counts: list[int], saturation: float, clients: int, tmp: Path
        ) -> dict[str, Any]:
    """Gives every phase's numbers (see the module docstring)."""
    from e2e_gpu import model_dir

    flags = {**spec["engine"], "served_model_name": "served"}
    model = str(model_dir(tmp, "throughput-shape", spec["throughput_model"]))
    prompts, out_lens = recipe(spec["requests"], *spec["lengths"],
                               spec["throughput_model"]["vocab_size"])
    samples = as_samples(prompts, out_lens)
    cpu = spec["engine"].get("device") == "cpu"  # the smoke run: fork, torch imported once
    offline = call_in_fresh_process(offline_throughput, model, spec["engine"], prompts, out_lens,
                                    reuse_imports=cpu)
    print(f"offline: {offline['output_tok_s']:.0f} output tok/s", flush=True)
    result: dict[str, Any] = {"offline": offline, "served_inf": {}}
    for count in counts:
        with kvpilot_serve(model, flags, count, tmp / f"serve-{count}.log") as (base, serve):
            load(base, samples[:4])  # warm-up, as offline gets
            row = served_row(load(base, samples, clients=clients, serve=serve),
                             offline["output_tok_s"])
            result["served_inf"][str(count)] = row
            print(f"served, {count} API server(s), rate inf: {row['output_tok_s']:.0f} tok/s "
                  f"({row['ratio_to_offline']:.2f}x)", flush=True)
            if count == counts[0]:
                rate = saturation * row["request_rate_reached"]
                poisson = served_row(load(base, samples, rate, clients, serve),
                                     offline["output_tok_s"])
                result["served_poisson"] = {"request_rate": rate, "api_servers": count,
                                            **poisson}
    model = str(model_dir(tmp, "batch1-shape", spec["batch1_model"]))
    b1_flags = {**spec["batch1_engine"], "served_model_name": "served"}
    offline_b1 = call_in_fresh_process(offline_batch1, model, spec["batch1_engine"],
                                       spec["batch1_prompt"], spec["batch1_tokens"],
                                       reuse_imports=cpu)
    prompt = [random.Random(1).randint(0, 500) for _ in range(spec["batch1_prompt"])]
    one = as_samples([prompt], [spec["batch1_tokens"]])
    with kvpilot_serve(model, b1_flags, counts[0], tmp / "serve-batch1.log") as (base, _):
        load(base, one)  # warm-up
        served_b1 = load(base, one)
    served_ms = served_b1["mean_tpot_ms"]
    result["batch1"] = {"offline_ms_per_token": offline_b1["ms_per_token"],
                        "served_ms_per_token": served_ms,
                        "served_over_offline_speed": offline_b1["ms_per_token"] / served_ms,
                        "new_tokens": spec["batch1_tokens"], "served": served_b1}
    return result


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def markdown(r: dict[str, Any]) -> str:
    off = r["offline"]["output_tok_s"]
    lines = [f"# Served vs offline ({r['machine']}, {r['date']}{', smoke' if r['smoke'] else ''})",
             "", f"{r['requests']} requests, input and output lengths uniform in "
             f"{r['lengths'][0]}..{r['lengths'][1]} (ignore_eos), dummy weights; goals: "
             "served >= 0.95x offline, ITL p99 <= 2x p50 at rate inf; batch 1 >= 0.95x.", "",
             "| path | output tok/s | x offline | ITL p50 ms | ITL p99 ms | p99/p50 | "
             "mean TTFT ms | CPU us/token: API servers, core, load generators |",
             "|---|---|---|---|---|---|---|---|",
             f"| offline `LLM.generate` | {off:.0f} | 1.00 | - | - | - | - | - |"]
    rows = [(f"served, {n} API server(s), rate inf", row)
            for n, row in r["served_inf"].items()]
    p = r["served_poisson"]
    rows.append((f"served, Poisson {p['request_rate']:.2f} req/s", p))
    for name, row in rows:
        lines.append(f"| {name} | {row['output_tok_s']:.0f} | {row['ratio_to_offline']:.2f} | "
                     f"{row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | "
                     f"{row['itl_p99_over_p50']:.2f} | {row['ttft_mean_ms']:.0f} | "
                     f"{row['api_server_cpu_us_per_token']:.0f}, "
                     f"{row['core_cpu_us_per_token']:.0f}, "
                     f"{row['loadgen_cpu_us_per_token']:.0f} |")
    lines += ["", "Where the ITL tail comes from (ITLs over 2x p50: their share of all ITLs, the "
              "part of them during the burst's prefill phase; tokens that arrived sharing a "
              "chunk):", ""]
    for name, row in rows:
        t = row["itl_tail"]
        lines.append(f"- {name}: {t['over_2x_p50']:.2%} of ITLs, "
                     f"{t['over_2x_p50_in_prefill_phase']:.0%} of them in the prefill phase; "
                     f"{t['tokens_sharing_a_chunk']:.2%} of tokens shared a chunk")
    b = r["batch1"]
    lines += ["", f"Batch 1 ({b['new_tokens']} tokens): offline {b['offline_ms_per_token']:.2f} "
              f"ms/token, served {b['served_ms_per_token']:.2f} ms/token (mean TPOT): served "
              f"speed {b['served_over_offline_speed']:.2f}x offline.", "",
              f"Reproduce: `python bench/serve_vs_offline.py --out DIR --api-server-counts "
              f"{','.join(r['served_inf'])} --clients {r['clients']}"
              f" --max-num-batched-tokens {r['max_num_batched_tokens']}"
              f"{' --smoke' if r['smoke'] else ''}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--api-server-counts", default="1",
                        help="comma-separated --api-server-count values to serve with")
    parser.add_argument("--saturation", type=float, default=0.9,
                        help="Poisson rate as a fraction of the rate-inf request rate")
    parser.add_argument("--clients", type=int, default=4,
                        help="load generator processes sending the served requests")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step, both sides (default: the "
                             "recipe's 16384): smaller steps bound the inter-token latency")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every phase")
    args = parser.parse_args()
    counts = [int(c) for c in args.api_server_counts.split(",")]
    spec = SMOKE if args.smoke else full_spec()
    if args.smoke:
        one_thread_per_process()
    if args.max_num_batched_tokens is not None:
        spec = {**spec, "engine": {**spec["engine"],
                                   "max_num_batched_tokens": args.max_num_batched_tokens}}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = run(spec, counts, args.saturation, args.clients, Path(tmp))
        finally:  # the servers' logs (with KVPILOT_SLOW_STEP_MS set: the core's slow steps)
            for log in Path(tmp).glob("serve-*.log"):
                shutil.copy(log, args.out / log.name)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine(), "smoke": args.smoke, "requests": spec["requests"],
              "lengths": spec["lengths"], "clients": args.clients,
              "max_num_batched_tokens": spec["engine"].get("max_num_batched_tokens", 8192),
              **result}
    (args.out / "serve_vs_offline.json").write_text(json.dumps(record, indent=1) + "\n")
    table = markdown(record)
    (args.out / "serve_vs_offline.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
