"""Which NIXL operations move VRAM between two processes at NVLink speed (issue 22).

Two processes on a 2-GPU host: the target owns a buffer on one GPU and registers it; the
initiator owns a buffer on the other GPU, adds the target's agent and moves the same bytes
with one transfer, as READ (pull: the target's bytes into the initiator's buffer) and as
WRITE (push: the initiator's bytes into the target's buffer), with one large descriptor
and with many 32 KiB descriptors (one block of one layer of the 8B shape, what a KV pull
moves per descriptor), each after a warm-up and checked byte for byte.

`--visible both` gives both processes both GPUs (target cuda:0, initiator cuda:1);
`--visible split` gives each process only its own GPU (CUDA_VISIBLE_DEVICES), as two
pods of one node have them.

    python bench/nixl_probe_gpu.py [--mib 256] [--visible both|split] [--repeat 3]
    python bench/nixl_probe_gpu.py --local pinned   # the initiator's side in pinned host memory
    python bench/nixl_probe_gpu.py --device cpu --mib 8     # DRAM, checks the script

Prints one line per (op, descriptor size): GB/s (median) and whether the bytes matched.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

PIECE = 32 << 10  # one 8B-shaped block's K (or V) of one layer: 16 x 8 x 128 x 2 bytes


def make_agent(name: str):
    """Gives a raw nixl agent with the UCX backend and a progress thread, as the engine's."""
    from kvpilot.engine.kv_transfer.nixl_agent import nixl_api

    api = nixl_api()
    return api.nixl_agent(name, api.nixl_agent_config(True, False, 0, backends=["UCX"]))


def buffer(device: str, nbytes: int, fill: int):
    """Gives a filled uint8 buffer on `device` ("pinned": page-locked host memory)."""
    import torch

    if device == "pinned":
        return torch.full((nbytes,), fill, dtype=torch.uint8).pin_memory()
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


def descs(base: int, nbytes: int, piece: int, dev: int) -> np.ndarray:
    count = nbytes // piece
    addrs = base + np.arange(count, dtype=np.uint64) * np.uint64(piece)
    return np.stack([addrs, np.full(count, piece, np.uint64),
                     np.full(count, dev, np.uint64)], axis=1)


def target(conn: Connection, device: str, nbytes: int) -> None:
    """Owns the remote buffer: registers it, sends metadata, answers fills and checks."""
    import torch

    if device != "cpu":
        torch.cuda.set_device(device)
    buf = buffer(device, nbytes, 7)
    mem = "DRAM" if device == "cpu" else "VRAM"
    dev = 0 if device == "cpu" else torch.device(device).index
    agent = make_agent("target")
    agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev, mem))
    while True:
        command = conn.recv()
        if command is None:
            break
        if command[0] == "fill":
            buf.fill_(command[1])
            if device != "cpu":
                torch.cuda.synchronize()
            conn.send(True)
        elif command[0] == "check":
            conn.send(bool((buf == command[1]).all().item()))


def initiator(conn: Connection, device: str, nbytes: int, repeat: int) -> list[dict]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    metadata, remote_base, remote_dev, remote_mem = conn.recv()
    buf = buffer(device, nbytes, 1)
    mem = "VRAM" if device.startswith("cuda") else "DRAM"
    dev = torch.device(device).index or 0 if device.startswith("cuda") else 0
    agent = make_agent("initiator")
    agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
    name = agent.add_remote_agent(metadata)
    rows = []
    for op in ("WRITE", "READ"):
        for piece in (nbytes, PIECE):
            local = agent.get_xfer_descs(descs(buf.data_ptr(), nbytes, piece, dev), mem)
            remote = agent.get_xfer_descs(descs(remote_base, nbytes, piece, remote_dev),
                                          remote_mem)
            times, ok, error = [], True, ""
            for index in range(repeat + 1):
                mark = 10 + index
                if op == "WRITE":
                    buf.fill_(mark)
                    conn.send(("fill", 0))
                else:
                    conn.send(("fill", mark))
                    buf.fill_(0)
                conn.recv()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                started = time.perf_counter()
                try:
                    handle = agent.initialize_xfer(op, local, remote, name)
                    state = agent.transfer(handle)
                    deadline = started + 60
                    while state == "PROC" and time.perf_counter() < deadline:
                        state = agent.check_xfer_state(handle)
                    agent.release_xfer_handle(handle)
                except Exception as exc:  # a probe reports and goes on
                    error, state = repr(exc)[:200], "ERR"
                elapsed = time.perf_counter() - started
                if state != "DONE":
                    ok, error = False, error or f"state {state}"
                    break
                if op == "WRITE":
                    conn.send(("check", mark))
                    ok = ok and conn.recv()
                else:
                    ok = ok and bool((buf == mark).all().item())
                if index:
                    times.append(elapsed)
            rate = nbytes / statistics.median(times) / 1e9 if times else 0.0
            rows.append({"op": op, "local": mem, "piece_bytes": piece, "descriptors": nbytes // piece,
                         "gb_s": rate, "bytes_match": ok, "error": error})
            print(f"{mem} {op:5s} {nbytes // piece:6d} x {piece:>10d} B: {rate:8.2f} GB/s "
                  f"match={ok} {error}", flush=True)
    conn.send(None)
    return rows


def run_target(conn: Connection, device: str, nbytes: int, visible: str | None) -> None:
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    target(conn, device, nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--visible", choices=["both", "split"], default="both")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--local", choices=["vram", "pinned"], default="vram",
                        help="the initiator's buffer: on its GPU, or pinned host memory")
    args = parser.parse_args()
    nbytes = args.mib << 20
    if args.device == "cpu":
        devices, visible = ("cpu", "cpu"), (None, None)
    elif args.visible == "both":
        devices, visible = ("cuda:0", "cuda:1" if args.local == "vram" else "pinned"), \
            (None, None)
    else:
        devices, visible = ("cuda:0", "cuda:0"), ("0", "1")
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=run_target, args=(theirs, devices[0], nbytes, visible[0]))
    child.start()
    if visible[1] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[1]
    try:
        rows = initiator(ours, devices[1], nbytes, args.repeat)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    print("RESULT " + json.dumps({"visible": args.visible, "local": args.local, "device": args.device,
                                  "bytes": nbytes, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
