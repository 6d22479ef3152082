"""NIXL vs TCP KV transfer rate for the same blocks between two engines' processes (issue 22).

One long prompt's blocks (Llama-3-8B or Llama-3.2-1B shaped, bf16) sit in a prefill
store's paged caches on cuda:0, in a child process (the prefill engine's side: its
store, its TCP and NIXL KV agents, its NIXL send region); this process is the decode
side on cuda:1. Each rate moves all of a fresh prompt's blocks:

- `tcp`: a `TcpConnector` pull (BLOCK frames into pinned receive buffers, copied into a
  pinned host pool): what a `--kv-transport tcp` decode engine runs;
- `nixl-pull`: the same pull with NIXL agents on both sides (`--kv-transport nixl`): the
  prefill side packs the blocks into its send region, the decode side READs them into its
  landing pool on cuda:1 (`contracts.nixl_memory.LANDING_BYTES`): what a NIXL decode engine runs;
- `nixl-vram`: one NIXL READ of the blocks straight from the prefill caches (one
  descriptor per block, layer and K/V) into rows on cuda:1, for comparison;
- `nixl-region-vram`: the blocks packed into the send region (its time reported apart as
  `pack_ms`), then one READ of those rows into rows on cuda:1.

The step that later copies landed rows into the decode cache is not timed, for either
transport. Writes kv_nixl_gpu-<shape>.json and .md under --out.

    python bench/kv_nixl_gpu.py [--shape 8b] [--tokens 8192] [--repeat 3] [--out DIR]
    python bench/kv_nixl_gpu.py --smoke --out DIR   # CPU, DRAM, tiny shape: checks the script
    python bench/kv_nixl_gpu.py --device cpu --shape 1b --tokens 2048   # DRAM to DRAM
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.nixl_memory import LANDING_BYTES
from kvpilot.engine.core.block_pool import BlockPool
from kvpilot.engine.kv_connector.host_pool import HostKVPool
from kvpilot.engine.kv_connector.landing_store import LandingStore
from kvpilot.engine.kv_transfer.engine_store import EngineBlockStore
from kvpilot.engine.kv_transfer.nixl_agent import NixlAgent
from kvpilot.engine.kv_transfer.tcp import TcpConnector

BLOCK = 16
SHAPES = {"tiny": (2, 2, 16), "1b": (16, 8, 64), "8b": (32, 8, 128)}  # layers, kv heads, dim
RESULTS = Path(__file__).parent / "results"


def make_store(num_blocks: int, shape: str, device: str) -> EngineBlockStore:
    layers, heads, dim = SHAPES[shape]
    caches = [torch.randn(2, num_blocks, BLOCK, heads, dim, device=device).to(torch.bfloat16)
              for _ in range(layers)]
    return EngineBlockStore(BlockPool(num_blocks), caches, BLOCK)


def cache_prompt(store: EngineBlockStore, tokens: list[int]) -> list[int]:
    """Caches the prompt's blocks in the store as if computed; gives their block ids."""
    hashes = hash_prompt_blocks(tokens, BLOCK)
    blocks = store.pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        store.pool.cache(block, block_hash)
    store.pool.free(blocks[::-1])
    return [b.block_id for b in blocks]


def time_calls(obj: object, name: str, seconds: list[float]) -> None:
    """Wraps method `name` of `obj` so that each call's seconds are appended to `seconds`."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(obj, name, timed)


def prefill_side(conn: Connection, shape: str, num_blocks: int, region_rows: int,
                 device: str) -> None:
    """The prefill engine's side, in its own process: caches prompts, offers leases to its
    TCP and NIXL agents, packs blocks into its send region, answers byte checks."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    src = make_store(num_blocks, shape, device)
    nixl = NixlAgent("bench-prefill")
    nixl.register_caches(src.caches)
    region = nixl.register_region(torch.empty((region_rows, src.block_bytes),
                                              dtype=torch.uint8, device=device))
    agents = {"tcp": TcpConnector(src, "127.0.0.1", 0),
              "nixl": TcpConnector(src, "127.0.0.1", 0, nixl=nixl)}
    packs: list[float] = []
    time_calls(src, "slots", packs)  # the pack of a NIXL pull, for the report
    for agent in agents.values():
        agent.start()
    conn.send(({name: agent.port for name, agent in agents.items()}, nixl.offer(),
               src.block_bytes))
    try:
        while (command := conn.recv()) is not None:
            verb, *rest = command
            if verb == "cache":  # -> block ids
                conn.send(cache_prompt(src, rest[0]))
            elif verb == "offer":  # (agent, lease, tokens) -> True
                with src.lock:
                    agents[rest[0]].offer(rest[1], rest[2])
                conn.send(True)
            elif verb == "pack":  # tokens -> (rows, seconds)
                hashes, handle = src.pin(rest[0])
                started = time.perf_counter()
                src.slots(handle, hashes, out=region.rows[:len(hashes)])
                conn.send((len(hashes), time.perf_counter() - started))
                src.unpin(handle)
            elif verb == "block":  # block id -> its wire-layout bytes
                data = torch.stack([c[:, rest[0]] for c in src.caches]).view(torch.uint8)
                conn.send(data.reshape(-1).cpu().numpy().tobytes())
            elif verb == "row":  # region row -> its bytes
                conn.send(region.rows[rest[0]].cpu().numpy().tobytes())
            elif verb == "packs":  # -> the pack seconds since the last ask
                conn.send(list(packs))
                packs.clear()
    finally:
        for agent in agents.values():
            agent.stop()


class Prefill:
    """The parent's handle on the prefill side's process."""

    def __init__(self, args: argparse.Namespace, num_blocks: int, region_rows: int,
                 device: str) -> None:
        context = mp.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=prefill_side, args=(
            theirs, args.shape, num_blocks, region_rows, device), daemon=True)
        self.process.start()
        if not self.conn.poll(300):
            raise SystemExit("the prefill side did not start in 300 s")
        self.ports, self.offer, self.block_bytes = self.conn.recv()
        self.count = 0

    def ask(self, *command: object) -> object:
        self.conn.send(command)
        return self.conn.recv()

    def fresh_prompt(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """Gives (token ids, block ids) of a new prompt, cached on the prefill side."""
        first = self.count * 100_000
        self.count += 1
        tokens = list(range(first, first + num_blocks * BLOCK))
        block_ids = self.ask("cache", tokens)
        assert isinstance(block_ids, list)
        return tokens, block_ids

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


class Phases:
    """Seconds a NIXL pull spends in its parts: the prefill side's pack, the READ, the
    landing pool's reserve and land; the rest is the conversation (TCP frames, threads)."""

    def __init__(self, agent: NixlAgent, store: LandingStore) -> None:
        self.seconds: dict[str, list[float]] = {"read": [], "reserve": [], "land": []}
        for obj, name, key in ((agent, "_read", "read"), (store, "reserve", "reserve"),
                               (store, "land", "land")):
            time_calls(obj, name, self.seconds[key])

    def take(self) -> dict[str, float]:
        """Gives each part's seconds since the last take, and forgets them."""
        out = {key: sum(values) for key, values in self.seconds.items()}
        for values in self.seconds.values():
            values.clear()
        return out


def pull_times(prefill: Prefill, decode: TcpConnector, name: str, num_blocks: int,
               repeat: int, phases: Phases | None = None) -> tuple[list[float], list[dict]]:
    """Gives the seconds of `repeat` pulls of fresh prompts by the prefill side's `name`
    agent into `decode`, after one warm-up pull, and each timed pull's parts (`phases`)."""
    times, parts = [], []
    for index in range(repeat + 1):
        if phases is not None:
            phases.take()
            prefill.ask("packs")
        tokens, _ = prefill.fresh_prompt(num_blocks)
        lease = f"{name}-{index}"
        prefill.ask("offer", name, lease, tokens)
        started = time.perf_counter()
        done = asyncio.run(request_pull(("127.0.0.1", decode.port),
                                        ("127.0.0.1", prefill.ports[name]), lease, timeout=120))
        times.append(time.perf_counter() - started)
        if done["imported"] != num_blocks or done["transport"] != decode.transport:
            raise SystemExit(f"pull {lease} imported {done['imported']} of {num_blocks} "
                             f"blocks, expected by {decode.transport}: {done}")
        if phases is not None and index:
            part = {"pack": sum(prefill.ask("packs")), **phases.take()}  # type: ignore[arg-type]
            part["other"] = times[-1] - sum(part.values())
            parts.append({key: value * 1e3 for key, value in part.items()})
    return times[1:], parts


def vram_reads(reader: NixlAgent, prefill: Prefill, num_blocks: int, device: str,
               repeat: int, packed: bool) -> tuple[list[float], list[float]]:
    """Gives (READ seconds, pack seconds) of `repeat` READs of a fresh prompt's blocks into
    rows on `device`: from the prefill caches' pieces, or (`packed`) from its send region
    after packing them there; the first READ is checked byte for byte, not timed."""
    peer, layout = reader.connect(prefill.offer)
    rows = torch.empty((num_blocks, layout.block_bytes), dtype=torch.uint8, device=device)
    reads, packs = [], []
    for index in range(repeat + 1):
        tokens, ids = prefill.fresh_prompt(num_blocks)
        if packed:
            count, pack_s = prefill.ask("pack", tokens)  # type: ignore[misc]
            assert count == num_blocks
            packs.append(pack_s)
        started = time.perf_counter()
        if packed:
            reader.read_rows(peer, layout, list(range(num_blocks)), rows, timeout=120)
        else:
            reader.read(peer, layout, ids, rows, timeout=120)
        reads.append(time.perf_counter() - started)
        if index == 0:
            expected = prefill.ask("row", num_blocks - 1) if packed else \
                prefill.ask("block", ids[-1])
            if rows[-1].cpu().numpy().tobytes() != expected:
                raise SystemExit("the NIXL READ's last row is not the source block")
    return reads[1:], packs[1:]


def measure(args: argparse.Namespace) -> dict:
    """Gives each transport's rates (GB/s per run), or the error that stopped it."""
    devices = ("cpu", "cpu") if args.device == "cpu" else ("cuda:0", "cuda:1")
    if devices[1] != "cpu":
        torch.cuda.set_device(devices[1])
    num_blocks = args.tokens // BLOCK
    prefill = Prefill(args, num_blocks * (4 * args.repeat + 6) + 1, num_blocks, devices[0])
    block_bytes = prefill.block_bytes
    pinned = args.device == "cuda"
    # the pools decode engines land pulls in: pinned host memory for TCP, the GPU for NIXL
    landing = min(num_blocks * (args.repeat + 2), max(1, LANDING_BYTES // block_bytes))
    host = LandingStore(HostKVPool(num_blocks * (args.repeat + 2), block_bytes, pinned),
                        BlockPool(1), pin_memory=pinned)
    gpu = LandingStore(HostKVPool(landing, block_bytes, pinned, device=devices[1]),
                       BlockPool(1), pin_memory=pinned)
    if pinned:
        host.receive_buffers.fill()  # as a decode engine does at start-up
    decode_nixl = NixlAgent("bench-decode")
    decoders = {"tcp": TcpConnector(host, "127.0.0.1", 0),
                "nixl": TcpConnector(gpu, "127.0.0.1", 0, nixl=decode_nixl)}
    phases = Phases(decode_nixl, gpu)
    bytes_moved = num_blocks * block_bytes
    parts: list[dict] = []
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    pack_s: list[float] = []
    try:
        for decode in decoders.values():
            decode.start()
        for name, decode in decoders.items():
            label = "tcp" if name == "tcp" else "nixl-pull"
            try:
                times[label], timed = pull_times(prefill, decode, name, num_blocks,
                                                 args.repeat, phases if name == "nixl" else None)
                parts += timed
            except (Exception, SystemExit) as exc:  # a bench reports what failed and goes on
                errors[label] = repr(exc)
        for label, packed in (("nixl-vram", False), ("nixl-region-vram", True)):
            try:
                times[label], packs = vram_reads(decode_nixl, prefill, num_blocks, devices[1],
                                                 args.repeat, packed)
                pack_s += packs
            except (Exception, SystemExit) as exc:
                errors[label] = repr(exc)
    finally:
        for decode in decoders.values():
            decode.stop()
        prefill.close()
    rates = {name: [bytes_moved / t / 1e9 for t in runs] for name, runs in times.items()}
    medians = {name: statistics.median(runs) for name, runs in rates.items()}
    for name, error in errors.items():
        print(f"{name}: FAILED {error}", flush=True)
    tcp = medians.get("tcp")
    return {"rates_gb_s": medians, "runs_gb_s": rates, "errors": errors,
            "bytes_per_transfer": bytes_moved, "blocks": num_blocks,
            "pack_ms": statistics.median(pack_s) * 1e3 if pack_s else None,
            "nixl_pull_parts_ms": {key: statistics.median(p[key] for p in parts)
                                   for key in parts[0]} if parts else {},
            "over_tcp": {name: rate / tcp for name, rate in medians.items()} if tcp else {}}


def device_names(args: argparse.Namespace) -> str:
    if args.smoke:
        return "CPU, DRAM (smoke test, not a measurement)"
    if args.device == "cpu":
        return "CPU, DRAM to DRAM (no GPU)"
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA GPUs, torch sees {torch.cuda.device_count()}")
    return " -> ".join(torch.cuda.get_device_name(i) for i in (0, 1))


def write_report(report: dict, out: Path, shape: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kv_nixl_gpu-{shape}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# KV transfer rate, NIXL vs TCP ({report['date']})", "",
             f"{report['devices']}; `{report['flags']}`; {report['blocks']} blocks of "
             f"{report['bytes_per_transfer'] // report['blocks']} bytes per transfer "
             "(median of the runs).", "",
             "| transport | GB/s | x TCP |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.2f} | {report['over_tcp'].get(name, float('nan')):.1f} |"
              for name, rate in report["rates_gb_s"].items()]
    lines += [f"| {name} | failed: {error} | |" for name, error in report["errors"].items()]
    if report.get("nixl_pull_parts_ms"):
        lines += ["", "A `nixl-pull`'s parts (median ms): " + ", ".join(
            f"{key} {value:.1f}" for key, value in report["nixl_pull_parts_ms"].items())
            + " (other: the conversation's frames and threads)."]
    if report.get("pack_ms") is not None:
        lines += ["", f"Packing the blocks into the send region (before `nixl-region-vram`'s "
                      f"READ, on the prefill GPU): {report['pack_ms']:.2f} ms."]
    (out / f"kv_nixl_gpu-{shape}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: both stores and the raw READ's target in DRAM")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, DRAM registrations, tiny shape, 256 tokens: checks the script")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.shape, args.tokens, args.repeat = "cpu", "tiny", 256, 1
    devices = device_names(args)
    report = {"date": datetime.date.today().isoformat(), "devices": devices,
              "flags": f"--shape {args.shape} --tokens {args.tokens} --repeat {args.repeat}"
                       + (" --smoke" if args.smoke else f" --device {args.device}"),
              **measure(args)}
    write_report(report, args.out, args.shape)
    print(f"{devices}: " + ", ".join(
        f"{k} {v:.2f} GB/s ({report['over_tcp'].get(k, float('nan')):.1f}x tcp)"
        for k, v in report["rates_gb_s"].items()), flush=True)
    if report["errors"]:
        raise SystemExit(f"failed: {', '.join(report['errors'])}")


if __name__ == "__main__":
    main()
