"""Engines that clean up after themselves: parallel `LLM`s one after the other in one process
(each leaves no worker, process group, thread or device memory behind), an `LLM` released by
`with`, `shutdown()` or its last reference, and `kvpilot serve`'s engine core on SIGTERM
leaving no rank behind (its child processes counted)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from kvpilot.engine.entrypoints.llm import LLM, SamplingParams
from kvpilot.engine.executor.processes import WORKER_MODULE

SCRIPT = Path(__file__).with_name("two_engines.py")
TOPOLOGIES = {"tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}
GONE_WITHIN_S = 30  # generous on a loaded 2-core machine


def run_script(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0, (lines, out.stderr[-3000:])
    return lines


def test_parallel_llms_one_after_another_in_one_process_leave_nothing_behind() -> None:
    engines = run_script("--engines", "tp2,tp2,pp2")
    assert [(e["topology"], e["released_by"], e["workers"]) for e in engines] == [
        ("tp2", "with", 1), ("tp2", "del", 1), ("pp2", "shutdown", 1)]
    assert all(set(e["left"]) <= {"fds"} for e in engines[:1])
    assert [e["left"] for e in engines[1:]] == [{}, {}]
    assert len({json.dumps(e["tokens"]) for e in engines}) == 1


@pytest.mark.gpu
def test_parallel_llms_one_after_another_on_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    engines = run_script("--engines", "tp2,tp2,pp2", "--device", "cuda")
    assert [e["left"] for e in engines[1:]] == [{}, {}]


def test_an_llm_is_released_by_with_shutdown_and_its_last_reference() -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM("tiny-llama", num_kv_blocks=32) as llm:
        engine = weakref.ref(llm.engine)
        expected = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine() is None  # the model and KV cache went with it
    with pytest.raises(RuntimeError, match=re.escape("this LLM was shut down: create a new "
                                                     "LLM(...)")):
        llm.generate(["hi"], params)
    llm.shutdown()  # idempotent
    llm = LLM("tiny-llama", num_kv_blocks=32)
    engine = weakref.ref(llm.engine)
    assert llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    del llm
    assert engine() is None


def descendants(pid: int) -> list[psutil.Process]:
    """Gives the live processes below `pid` (the engine core, its workers, helpers)."""
    return [p for p in psutil.Process(pid).children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE]


@contextmanager
def parallel_server(log: Path, topology: list[str]) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                      psutil.Process,
                                                                      psutil.Process]]:
    """Gives (`kvpilot serve`, its engine core, the core's worker) once it serves."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli.main", "serve", "tiny-llama",
                                 "--device", "cpu", "--num-kv-blocks", "64", "--port", "0",
                                 *topology], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "listening on" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        workers = [p for p in descendants(proc.pid) if WORKER_MODULE in " ".join(p.cmdline())]
        assert len(workers) == 1, log.read_text()
        (core,) = [p for p in psutil.Process(proc.pid).children()
                   if "spawn_main" in " ".join(p.cmdline()) and workers[0] in p.children()]
        yield proc, core, workers[0]
    finally:
        for process in descendants(proc.pid) if proc.poll() is None else []:
            process.kill()  # so that a failure leaves nothing behind
        proc.kill()
        proc.wait(30)


def gone(process: psutil.Process) -> bool:
    """Gives whether `process` has exited (a zombie its parent has not reaped counts)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Gives those of `processes` still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(not gone(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in processes if not gone(p)]


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_the_engine_core_on_sigterm_leaves_no_rank_behind(tmp_path: Path,
                                                          topology: str) -> None:
    log = tmp_path / "serve.log"
    with parallel_server(log, TOPOLOGIES[topology]) as (proc, core, worker):
        ranks = [core, *descendants(core.pid)]
        assert worker in ranks
        if topology == "tp2":  # the core itself is told to stop, as its launcher does
            core.send_signal(signal.SIGTERM)
            assert wait_gone(ranks, GONE_WITHIN_S) == [], log.read_text()
        else:  # `kvpilot serve` is told to stop: it drains, then SIGTERMs its core
            below = descendants(proc.pid)  # its API server helpers too
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(GONE_WITHIN_S * 2) == 0, log.read_text()
            assert wait_gone(below, GONE_WITHIN_S) == [], log.read_text()
