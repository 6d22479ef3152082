"""Chaos with migration: steady streaming load through `kvpilot up`'s router while one replica
is SIGKILLed every few seconds (the supervisor restarts it) and another SIGSTOPped and
SIGCONTed; every stream must end without an error and with exactly the text an undisturbed
run of the same request gives (greedy or seeded), and each migration's added latency is
reported (the router's own measure, break to the continuation's first byte, and the client's:
the gap at the moved token less the stream's median gap). `--drain-streams N` then scales the
fleet down by one replica (the manifest edited, SIGHUP) while N long greedy streams run and
reports how long the leaving replica took to exit and whether every stream ended as the ones
that stayed put.

    python3 bench/chaos_migration.py --out bench/results/chaos_migration-CPU-DATE
    python3 bench/chaos_migration.py --out DIR --device cuda --shape 0.6b --dtype bfloat16 \
        --kv-cache-memory 4GiB --max-model-len 4096 --max-tokens 384 --workers 12 \
        --drain-streams 12 --drain-tokens 3000        # one GPU: bench/issue48/gpu_chaos.sh

`--shape 0.6b` serves a Qwen3-0.6B-shaped model (the bundled tiny tokenizer's vocabulary)
with random weights written to a safetensors checkpoint that `kvpilot up --model-dir` serves
(a manifest's `dummy:` source names only the built-in tiny configs). Writes summary.json,
summary.md (NOTES-ready) and the processes' logs under --out; the summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
MOVED = re.compile(r"stream (\S+) moved to \S+ after (\d+) tokens in ([\d.]+)s \((\w+):")
RELOADED = re.compile(r"reloaded .*: (\d+) -> (\d+) replica\(s\)(.*)")
READY = re.compile(r"engine ready in ([\d.]+)s")
DRAIN_PROMPT = "the drain's long story"


@dataclass
class Stream:
    key: int
    id: str = ""
    text: str = ""
    times: list[float] = field(default_factory=list)  # one per token event
    error: str = ""


def request_body(key: int, model: str, max_tokens: int) -> dict:
    """Gives request `key` of the fixed set: greedy for even keys, seeded for odd ones, of
    `max_tokens` to 1.6 x `max_tokens` tokens."""
    body = {"model": model, "prompt": f"chaos request {key}: tell a long story",
            "max_tokens": max_tokens + max_tokens // 12 * (key % 8), "ignore_eos": True,
            "stream": True}
    if key % 2:
        body.update(temperature=1.0, top_p=0.95, seed=key)
    else:
        body["temperature"] = 0
    return body


async def run_stream(client: httpx.AsyncClient, key: int, body: dict,
                     on_first: Callable[[], None] | None = None) -> Stream:
    """Gives the stream of one request: its id, text, event times, or the error it ended
    with; calls `on_first` at its first token."""
    out, pieces = Stream(key), []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    return out
                out.id = out.id or event["id"]
                if event["choices"]:
                    pieces.append(event["choices"][0]["text"])
                    out.times.append(time.monotonic())
                    if on_first is not None and len(pieces) == 1:
                        on_first()
            if not done:
                out.error = "the stream ended without data: [DONE]"
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    out.text = "".join(pieces)
    return out


def engine_pid(up: subprocess.Popen, url: str) -> int | None:
    """Gives the pid of the engine serving `url` now, None while it is being restarted."""
    port = url.rsplit(":", 1)[1]
    for child in psutil.Process(up.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return child.pid
    return None


async def chaos(up: subprocess.Popen, urls: list[str], seconds: float, kill_every: float,
                events: list[str], rng: random.Random) -> None:
    """SIGSTOPs a replica for 6-9 s, SIGCONTs it, 4-6 s later another, ...; and SIGKILLs a
    replica (not the stopped one) every `kill_every` seconds."""
    started = time.monotonic()
    stopped: tuple[int, float] | None = None
    next_kill = started + kill_every / 2
    next_stop = started + 3
    while time.monotonic() - started < seconds:
        now = time.monotonic()
        if stopped and now >= stopped[1]:
            os.kill(stopped[0], signal.SIGCONT)
            events.append(f"{now - started:.1f}s SIGCONT")
            stopped, next_stop = None, now + rng.uniform(4, 6)
        elif stopped is None and now >= next_stop:
            victim = rng.choice(urls)
            pid = engine_pid(up, victim)
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                stopped = (pid, now + rng.uniform(6, 9))
                events.append(f"{now - started:.1f}s SIGSTOP {victim}")
        if now >= next_kill:
            pids = [p for u in urls if (p := engine_pid(up, u)) is not None
                    and (not stopped or p != stopped[0])]
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                events.append(f"{now - started:.1f}s SIGKILL pid {pid}")
            next_kill = now + kill_every
        await asyncio.sleep(0.1)
    if stopped:
        os.kill(stopped[0], signal.SIGCONT)


async def load(url: str, seconds: float, workers: int, keys: int,
               body: Callable[[int], dict]) -> list[Stream]:
    results: list[Stream] = []
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            key = index
            while time.monotonic() < deadline:
                results.append(await run_stream(client, key % keys, body(key % keys)))
                key += workers

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return results


async def reference(url: str, keys: int, concurrency: int, body: Callable[[int], dict]
                    ) -> dict[int, str]:
    """Gives the undisturbed text of every key, `concurrency` requests at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(key: int) -> Stream:
            async with gate:
                return await run_stream(client, key, body(key))
        streams = await asyncio.gather(*(one(k) for k in range(keys)))
    failed = [s for s in streams if s.error]
    if failed:
        raise RuntimeError(f"the undisturbed run failed (no chaos yet): {failed[0].error}")
    return {s.key: s.text for s in streams}


async def wait_healthy(urls: list[str], timeout: float) -> None:
    """Waits until every engine answers /health (a killed one restarted, a stopped one
    continued); raises TimeoutError naming the laggards."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        pending = list(urls)
        while pending:
            for u in list(pending):
                try:
                    if (await client.get(f"{u}/health")).status_code == 200:
                        pending.remove(u)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"engines not healthy {timeout:.0f}s after the chaos: {pending}")
            await asyncio.sleep(0.5)


async def drain_check(up: subprocess.Popen, url: str, urls: list[str], manifest: dict,
                      fleet: Path, up_log: Path, args: argparse.Namespace) -> dict:
    """Scales the fleet down by one replica while `args.drain_streams` long greedy streams
    run; gives the seconds from SIGHUP to the leaving replica's exit, its exit line and the
    streams' outcome."""
    await wait_healthy(urls, 120)
    await asyncio.sleep(3)  # two router refreshes: the restarted replicas are ready there too
    body = {"model": args.model, "prompt": DRAIN_PROMPT, "max_tokens": args.drain_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started, seen = asyncio.Event(), [0]

    def first() -> None:
        seen[0] += 1
        if seen[0] == args.drain_streams:
            started.set()

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        streams = asyncio.ensure_future(asyncio.gather(
            *(run_stream(client, i, body, first) for i in range(args.drain_streams))))
        await asyncio.wait_for(started.wait(), 180)
        replicas = manifest["spec"]["decode"]["replicas"]
        manifest["spec"]["decode"]["replicas"] = replicas - 1
        fleet.write_text(yaml.safe_dump(manifest))
        offset = up_log.stat().st_size
        sighup = time.monotonic()
        up.send_signal(signal.SIGHUP)
        line = None
        while line is None:
            with up_log.open(errors="replace") as log:
                log.seek(offset)
                line = RELOADED.search(log.read())
            if line is None:
                if time.monotonic() - sighup > 180:
                    raise TimeoutError(f"no reload line 180 s after SIGHUP in {up_log}")
                await asyncio.sleep(0.1)
        drained = time.monotonic() - sighup
        running = not streams.done()  # the replica left before the generations ended
        result: list[Stream] = await streams
    return {"streams": result, "replicas": f"{line.group(1)} -> {line.group(2)}",
            "exit": line.group(3).removeprefix("; "), "drained_s": drained,
            "streams_running_at_exit": running}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def first_difference(a: str, b: str) -> int:
    """Gives the first character index where `a` and `b` differ (the shorter's length when
    one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def sample(stream: Stream, undisturbed: str, moves: list[tuple[int, float, str]]) -> dict:
    """Gives what tells a stream that differs from its undisturbed run apart: where the texts
    part, around it in both, and after how many tokens (and why) it moved, if it did."""
    at = first_difference(stream.text, undisturbed)
    return {"key": stream.key, "id": stream.id, "first_diff_char": at,
            "length": len(undisturbed), "moved_after_tokens": [t for t, _, _ in moves],
            "reasons": [r for _, _, r in moves], "text_there": stream.text[max(0, at - 30):at + 30],
            "undisturbed_there": undisturbed[max(0, at - 30):at + 30]}


def fleet_manifest(args: argparse.Namespace) -> tuple[dict, str | None]:
    """Gives the manifest to run and the --model-dir it needs (None: a built-in config)."""
    manifest = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text()))
    spec = manifest["spec"]
    spec["decode"]["replicas"] = args.replicas
    engine = spec["engine"]
    for key, value in (("dtype", args.dtype), ("kvCacheMemory", args.kv_cache_memory),
                       ("maxModelLen", args.max_model_len), ("maxNumSeqs", args.max_num_seqs),
                       ("maxNumBatchedTokens", args.max_num_batched_tokens)):
        if value is not None:
            engine[key] = value
    if args.device == "cuda":
        spec["accelerator"] = {"vendor": "nvidia"}
        spec.pop("overrides", None)  # the example's CPU requests and limits
    model_dir = None
    if args.shape == "0.6b":
        from shapes import QWEN3_0_6B, write_random_checkpoint  # bench/ is sys.path[0]

        from kvpilot.engine.contracts.builtin_models import (
            BOS_ID,
            ENDOFTEXT_ID,
            IM_END_ID,
            TINY_VOCAB_SIZE,
        )
        config = {**QWEN3_0_6B, "vocab_size": TINY_VOCAB_SIZE, "bos_token_id": BOS_ID,
                  "eos_token_id": [ENDOFTEXT_ID, IM_END_ID]}
        root = Path(args.model_root or tempfile.mkdtemp(prefix="kvpilot-chaos-"))
        began = time.monotonic()
        model_dir = str(write_random_checkpoint(root / "qwen3-0.6b-shape", config,
                                                dtype=engine["dtype"], device=args.device))
        print(f"wrote a random {engine['dtype']} checkpoint to {model_dir} in "
              f"{time.monotonic() - began:.1f}s", flush=True)
        spec["model"] = {"name": "qwen3-0.6b-shape", "source": "pvc://local/qwen3-0.6b-shape"}
    return manifest, model_dir


def notes(summary: dict) -> str:
    """Gives the NOTES-ready lines of one run: the row of the chaos table and the drain's."""
    def pair(table: dict, reason: str, scale: float = 1.0) -> str:
        item = table.get(reason)
        return f"{item['p50'] * scale:.2f} / {item['p99'] * scale:.2f} s" if item else "-"

    router, client = summary["router_break_to_first_byte_s"], summary["client_added_gap_s"]
    by_reason = {r: v["n"] for r, v in router.items()}
    lines = [
        f"{summary['device']} / {summary['model']} ({summary['dtype']}), {summary['replicas']} "
        f"replicas under `kvpilot up`, {summary['seconds']:.0f} s of load from "
        f"{summary['workers']} workers, {summary['keys']} fixed streams of "
        f"{summary['max_tokens']}-{summary['max_tokens'] * 19 // 12} tokens, a SIGKILL every "
        f"{summary['kill_every']:.0f} s; fleet ready in {summary['fleet_ready_s']:.0f} s, "
        f"engine starts {summary['engine_ready_s']}.",
        "",
        "| streams | client-visible errors | texts different from undisturbed (moved / not "
        "moved) | migrations (kill / stall) | router: break to first byte, kill p50 / p99 | "
        "stall p50 / p99 | client's added gap, kill p50 / p99 | stall p50 / p99 |",
        "|---|---|---|---|---|---|---|---|",
        f"| {summary['streams']} | **{summary['client_errors']}** | "
        f"**{summary['different_from_undisturbed']}** ({summary['different_moved']} / "
        f"{summary['different_not_moved']}) | {summary['migrations']} "
        f"({by_reason.get('upstream_failed', 0)} / {by_reason.get('stalled', 0)}) | "
        f"{pair(router, 'upstream_failed')} | {pair(router, 'stalled')} | "
        f"{pair(client, 'upstream_failed')} | {pair(client, 'stalled')} |",
    ]
    if summary["different_samples"]:
        lines += ["", "Texts that differ (first differing character vs. the tokens sent "
                  "before each move): " + "; ".join(
                      f"key {d['key']} at char {d['first_diff_char']} of {d['length']}, "
                      f"moved after {d['moved_after_tokens'] or 'never'}"
                      for d in summary["different_samples"])]
    if summary["error_samples"]:
        lines += ["", "Errors: " + "; ".join(summary["error_samples"])]
    drain = summary.get("drain")
    if drain:
        lines += ["", f"Drain: {drain['replicas']} replicas with {drain['streams']} greedy "
                  f"streams of {drain['tokens']} tokens in flight: the leaving replica "
                  f"{drain['exit'] or 'exit not logged'} {drain['drained_s']:.1f} s after "
                  f"SIGHUP (bound 30 s), streams handed over (`drained`): "
                  f"{drain['handed_over']}, errors: {drain['errors']}, {drain['distinct_texts']} distinct "
                  f"text(s) over the {drain['streams']} streams (moved equal to unmoved: "
                  f"{drain['moved_equal_unmoved']})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--keys", type=int, default=24)
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96,
                        help="key k asks for this + this/12 x (k mod 8) tokens")
    parser.add_argument("--reference-concurrency", type=int, default=1,
                        help="undisturbed requests at a time (a GPU batches them as the load)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: spec.accelerator.vendor nvidia (kvpilot serve --device "
                             "cuda); every replica on the one visible GPU")
    parser.add_argument("--shape", choices=("tiny", "0.6b"), default="tiny",
                        help="tiny: the example's dummy:tiny-llama; 0.6b: a Qwen3-0.6B-shaped "
                             "random checkpoint served with kvpilot up --model-dir")
    parser.add_argument("--model-root", default=None,
                        help="where --shape 0.6b writes its checkpoint (default: a temp dir)")
    parser.add_argument("--dtype", default=None, help="spec.engine.dtype (default: example's)")
    parser.add_argument("--kv-cache-memory", default=None, help="spec.engine.kvCacheMemory")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--ready-timeout", type=float, default=300.0,
                        help="kvpilot up --timeout: seconds each process gets to be ready")
    parser.add_argument("--drain-streams", type=int, default=0,
                        help="after the chaos, scale down by one replica with this many long "
                             "greedy streams in flight (0: no drain check)")
    parser.add_argument("--drain-tokens", type=int, default=400)
    args = parser.parse_args()
    # a `timeout` (SIGTERM) still stops the fleet and keeps what was measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    manifest, model_dir = fleet_manifest(args)
    args.model = manifest["spec"]["model"]["name"]
    fleet = args.out / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(manifest))
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    up_log = logs / "up.log"
    port = 18000 + os.getpid() % 1000
    began = time.monotonic()
    with up_log.open("ab") as err:
        up = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "up", str(fleet),
                               "--port", str(port), "--log-dir", str(logs), "--timeout",
                               str(args.ready_timeout),
                               *(["--model-dir", model_dir] if model_dir else [])],
                              stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def body(key: int) -> dict:
        return request_body(key, args.model, args.max_tokens)

    drain: dict | None = None
    try:
        assert up.stdout is not None
        first = up.stdout.readline().strip()
        if not first:
            raise RuntimeError(f"kvpilot up exited before serving:\n{up_log.read_text()[-3000:]}")
        print(first, flush=True)
        ready = time.monotonic() - began
        urls = [item.split("=", 1)[1] for item in
                (logs / "router-instances").read_text().strip().split(",")]

        async def run() -> tuple[dict[int, str], float, list[Stream], list[str], dict | None]:
            start = time.monotonic()
            texts = await reference(url, args.keys, args.reference_concurrency, body)
            took = time.monotonic() - start
            events: list[str] = []
            streams, _ = await asyncio.gather(
                load(url, args.seconds, args.workers, args.keys, body),
                chaos(up, urls, args.seconds, args.kill_every, events,
                      random.Random(args.seed)))
            drained = (await drain_check(up, url, urls, manifest, fleet, up_log, args)
                       if args.drain_streams else None)
            return texts, took, streams, events, drained

        texts, reference_s, streams, events, drain = asyncio.run(run())
    finally:
        for child in psutil.Process(up.pid).children():
            child.send_signal(signal.SIGCONT)
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    moved: dict[str, list[tuple[int, float, str]]] = {}
    router_log = logs / f"{manifest['metadata']['name']}-router.log"
    for line in router_log.read_text(errors="replace").splitlines():
        if (found := MOVED.search(line)):
            sid, tokens, took, reason = found.groups()
            moved.setdefault(sid, []).append((int(tokens), float(took), reason))
    errors = [s for s in streams if s.error]
    different = [s for s in streams if not s.error and s.text != texts[s.key]]
    router_cost: dict[str, list[float]] = {}
    client_added: dict[str, list[float]] = {}
    for s in streams:
        gaps = [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
        median = statistics.median(gaps) if gaps else 0.0
        for tokens, took, reason in moved.get(s.id, []):
            router_cost.setdefault(reason, []).append(took)
            if 0 < tokens < len(s.times):
                client_added.setdefault(reason, []).append(s.times[tokens] - s.times[tokens - 1]
                                                           - median)
    starts = [float(m.group(1)) for log in sorted(logs.glob("*.log"))
              for m in READY.finditer(log.read_text(errors="replace"))]
    summary = {
        "device": args.device, "model": args.model, "shape": args.shape,
        "dtype": manifest["spec"]["engine"]["dtype"], "replicas": args.replicas,
        "seconds": args.seconds, "kill_every": args.kill_every, "workers": args.workers,
        "keys": args.keys, "max_tokens": args.max_tokens, "fleet_ready_s": round(ready, 1),
        "engine_ready_s": f"{min(starts):.1f}-{max(starts):.1f} s ({len(starts)} starts)"
        if starts else "not logged", "reference_s": round(reference_s, 1),
        "streams": len(streams), "client_errors": len(errors),
        "different_from_undisturbed": len(different),
        "different_moved": sum(s.id in moved for s in different),
        "different_not_moved": sum(s.id not in moved for s in different),
        "migrations": sum(len(moved.get(s.id, [])) for s in streams),
        "events": events,
        "router_break_to_first_byte_s": {r: {"n": len(v), "p50": percentile(v, 0.5),
                                             "p99": percentile(v, 0.99)}
                                         for r, v in router_cost.items()},
        "client_added_gap_s": {r: {"n": len(v), "p50": percentile(v, 0.5),
                                   "p99": percentile(v, 0.99)}
                               for r, v in client_added.items()},
        "error_samples": [s.error for s in errors[:5]],
        "different_samples": [sample(s, texts[s.key], moved.get(s.id, []))
                              for s in different[:8]],
    }
    if drain is not None:
        drain_streams: list[Stream] = drain.pop("streams")
        handed = [s for s in drain_streams
                  if any(reason == "drained" for _, _, reason in moved.get(s.id, []))]
        unmoved = {s.text for s in drain_streams if not s.error and s.id not in moved}
        summary["drain"] = {
            **drain, "streams": len(drain_streams), "tokens": args.drain_tokens,
            "handed_over": len(handed), "errors": sum(bool(s.error) for s in drain_streams),
            "error_samples": [s.error for s in drain_streams if s.error][:3],
            "distinct_texts": len({s.text for s in drain_streams if not s.error}),
            "moved_equal_unmoved": (all(s.text in unmoved for s in handed) if unmoved
                                    else "no unmoved stream"),
        }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(notes(summary))
    print(json.dumps(summary, indent=2))
    print(notes(summary))


if __name__ == "__main__":
    main()
