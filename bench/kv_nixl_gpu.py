"""NIXL vs TCP KV transfer rate for the same blocks between two GPUs (issue 22).

One long prompt's blocks (Llama-3-8B or Llama-3.2-1B shaped, bf16) sit in a prefill
store's paged caches on cuda:0; each rate moves all of them to cuda:1:

- `tcp`: a `TcpConnector` pull into a decode engine's landing store (BLOCK frames into
  pinned receive buffers, copied into its pinned host tier): the transport before issue 22;
- `nixl-pull`: the same pull with NIXL agents on both sides (`--kv-transport nixl`): one
  READ of cuda:0's registered caches straight into the host tier's rows (what a decode
  engine runs; the step that needs the blocks then loads them onto its GPU, not timed
  here, nor for `tcp`);
- `nixl-vram`: one NIXL READ of the same blocks (descriptor lists of block slices:
  one per block, layer and K/V) from cuda:0's caches straight into rows on cuda:1;
- `nixl-region-vram`: the blocks packed into the prefill agent's send region (as a pull
  packs them: `EngineBlockStore.slots` into `nixl_region` rows, its time reported apart
  as `pack_ms`), then one READ of those rows (one descriptor per run) into rows on
  cuda:1: the GPU-to-GPU path the issue's >= 20x goal is about.

`nixl-pull` packs and reads the send region too (its READ lands in host memory).

All agents share this process (and its GIL), like bench/kv_transfer_rate.py; the host
tier is pinned memory of the process, as a decode engine on cuda:1 would have it. Writes
kv_nixl_gpu-<shape>.json and .md under --out.

    python bench/kv_nixl_gpu.py [--shape 8b] [--tokens 8192] [--repeat 3] [--out DIR]
    python bench/kv_nixl_gpu.py --smoke --out DIR   # CPU, DRAM, tiny shape: checks the script
    python bench/kv_nixl_gpu.py --device cpu --shape 1b --tokens 2048   # DRAM to DRAM
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.kv_client import request_pull
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


def pull(prefill: TcpConnector, decode: TcpConnector, tokens: list[int], lease: str) -> float:
    """Offers the prompt on `prefill`, pulls it into `decode`; gives the seconds it took."""
    with prefill.store.lock:
        prefill.offer(lease, tokens)
    started = time.perf_counter()
    done = asyncio.run(request_pull(("127.0.0.1", decode.port), ("127.0.0.1", prefill.port),
                                    lease, timeout=120))
    elapsed = time.perf_counter() - started
    if done["imported"] != len(tokens) // BLOCK or done["transport"] != decode.transport:
        raise SystemExit(f"pull {lease} imported {done['imported']} of "
                         f"{len(tokens) // BLOCK} blocks, expected by {decode.transport}: "
                         f"{done}")
    return elapsed


def vram_reads(reader: NixlAgent, offer: dict, src: EngineBlockStore, ids: list[int],
               device: str, repeat: int) -> list[float]:
    """Gives the seconds of `repeat` single READs of blocks `ids` of the peer that made
    `offer` into a tensor on `device`, after checking a first READ against the source."""
    peer, layout = reader.connect(offer)
    rows = torch.empty((len(ids), src.block_bytes), dtype=torch.uint8, device=device)
    times = []
    for index in range(repeat + 1):  # the first READ registers and checks: not timed
        started = time.perf_counter()
        reader.read(peer, layout, ids, rows, timeout=120)
        times.append(time.perf_counter() - started)
        if index == 0:
            expected = torch.stack([c[:, ids[-1]] for c in src.caches]).view(torch.uint8)
            if not torch.equal(rows[-1].cpu(), expected.reshape(-1).cpu()):
                raise SystemExit("the NIXL READ's last row is not the source block")
    return times[1:]


def region_reads(reader: NixlAgent, writer: NixlAgent, src: EngineBlockStore, prompts: Prompts,
                 device: str, repeat: int) -> tuple[list[float], list[float]]:
    """Gives (READ seconds, pack seconds) of `repeat` fresh prompts' blocks packed into
    `writer`'s send region and read from it into rows on `device`, after a checked first."""
    peer, layout = reader.connect(writer.offer())
    region = writer.region
    assert region is not None
    reads, packs = [], []
    for index in range(repeat + 1):
        tokens = prompts.next()[0]
        hashes, handle = src.pin(tokens)
        rows = torch.empty((len(hashes), src.block_bytes), dtype=torch.uint8, device=device)
        started = time.perf_counter()
        src.slots(handle, hashes, out=region.rows[:len(hashes)])
        packed = time.perf_counter()
        reader.read_rows(peer, layout, list(range(len(hashes))), rows, timeout=120)
        done = time.perf_counter()
        src.unpin(handle)
        if index == 0:
            if not torch.equal(rows.cpu(), region.rows[:len(hashes)].cpu()):
                raise SystemExit("the NIXL READ's rows are not the packed send region's")
            continue
        reads.append(done - packed)
        packs.append(packed - started)
    return reads, packs


class Prompts:
    """Fresh prompts of `num_blocks` blocks, cached in the source store as if computed."""

    def __init__(self, src: EngineBlockStore, num_blocks: int) -> None:
        self.src, self.num_blocks, self.count = src, num_blocks, 0

    def next(self) -> tuple[list[int], list[int]]:
        """Gives (token ids, block ids) of the next prompt."""
        first = self.count * 100_000
        self.count += 1
        tokens = list(range(first, first + self.num_blocks * BLOCK))
        return tokens, cache_prompt(self.src, tokens)


def pull_times(prefill: TcpConnector, decode: TcpConnector, prompts: Prompts, name: str,
               repeat: int) -> list[float]:
    """Gives the seconds of `repeat` pulls of fresh prompts, after one warm-up pull."""
    times = [pull(prefill, decode, prompts.next()[0], f"{name}-{index}")
             for index in range(repeat + 1)]
    return times[1:]


def measure(args: argparse.Namespace) -> dict:
    """Gives each transport's rates (GB/s per run), or the error that stopped it."""
    devices = ("cpu", "cpu") if args.device == "cpu" else ("cuda:0", "cuda:1")
    num_blocks = args.tokens // BLOCK
    src = make_store(num_blocks * (3 * args.repeat + 5) + 1, args.shape, devices[0])
    pinned = args.device == "cuda"
    dst = LandingStore(HostKVPool(num_blocks + 1, src.block_bytes, pin_memory=pinned),
                       BlockPool(1), pin_memory=pinned)
    if pinned:
        dst.receive_buffers.fill()  # as a decode engine does at start-up
    bytes_moved = num_blocks * src.block_bytes
    prompts = Prompts(src, num_blocks)
    prefill_nixl, decode_nixl = NixlAgent("bench-prefill"), NixlAgent("bench-decode")
    prefill_nixl.register_caches(src.caches)
    prefill_nixl.register_region(torch.empty((num_blocks, src.block_bytes), dtype=torch.uint8,
                                             device=devices[0]))
    agents = {"tcp": (TcpConnector(src, "127.0.0.1", 0), TcpConnector(dst, "127.0.0.1", 0)),
              "nixl-pull": (TcpConnector(src, "127.0.0.1", 0, nixl=prefill_nixl),
                            TcpConnector(dst, "127.0.0.1", 0, nixl=decode_nixl))}
    times: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    try:
        for prefill, decode in agents.values():
            prefill.start()
            decode.start()
        for name, (prefill, decode) in agents.items():
            try:
                times[name] = pull_times(prefill, decode, prompts, name, args.repeat)
            except (Exception, SystemExit) as exc:  # a bench reports what failed and goes on
                errors[name] = repr(exc)
        try:
            times["nixl-vram"] = vram_reads(decode_nixl, prefill_nixl.offer(), src,
                                            prompts.next()[1], devices[1], args.repeat)
        except (Exception, SystemExit) as exc:
            errors["nixl-vram"] = repr(exc)
        try:
            times["nixl-region-vram"], pack_s = region_reads(decode_nixl, prefill_nixl, src,
                                                             prompts, devices[1], args.repeat)
        except (Exception, SystemExit) as exc:
            errors["nixl-region-vram"], pack_s = repr(exc), []
    finally:
        for prefill, decode in agents.values():
            prefill.stop()
            decode.stop()
    rates = {name: [bytes_moved / t / 1e9 for t in runs] for name, runs in times.items()}
    medians = {name: statistics.median(runs) for name, runs in rates.items()}
    for name, error in errors.items():
        print(f"{name}: FAILED {error}", flush=True)
    tcp = medians.get("tcp")
    return {"rates_gb_s": medians, "runs_gb_s": rates, "errors": errors,
            "bytes_per_transfer": bytes_moved, "blocks": num_blocks,
            "pack_ms": statistics.median(pack_s) * 1e3 if pack_s else None,
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
