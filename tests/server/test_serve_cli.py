"""`kvpilot serve MODEL` as vLLM takes it, no silent default model, Hub ids from the local
cache only, --chat-template, and the start-up log lines."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.checkpoints import write_checkpoint
from server_harness import start_server

from kvpilot.cli.main import main
from kvpilot.engine.contracts.args import EngineArgs, model_from_cli
from kvpilot.engine.contracts.tokenizer import load_tokenizer, read_chat_template
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.models.loader import progress
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.worker.startup_log import LoadReport, log_load, log_topology


@pytest.mark.parametrize(("positional", "flag", "expected"), [
    ("tiny-llama", None, "tiny-llama"),
    (None, "tiny-llama", "tiny-llama"),  # --model still works
    ("org/m", "org/m", "org/m"),  # both, the same: fine
    ("org/a", "org/b", "model='org/a' and --model='org/b' disagree: give the model once, "
                       "e.g. `kvpilot serve org/a`"),
    (None, None, "no model given: `kvpilot serve MODEL` takes a model directory or a Hub id in "
                 "the local Hugging Face cache; `kvpilot serve tiny-llama` serves the built-in "
                 "random-weight model"),
])
def test_the_model_comes_positionally_or_by_flag(positional, flag, expected):
    if " " not in expected:
        assert model_from_cli(positional, flag, "serve") == expected
        return
    with pytest.raises(ValueError) as err:
        model_from_cli(positional, flag, "serve")
    assert str(err.value) == expected


def test_serve_without_a_model_refuses_naming_the_built_in(capsys: pytest.CaptureFixture[str]):
    assert main(["serve", "--port", "0"]) == 2
    assert "`kvpilot serve tiny-llama` serves the built-in" in capsys.readouterr().err


def test_serve_with_an_unknown_model_refuses_before_binding(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["serve", "acme/not-here", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "not in the local Hugging Face cache" in err and "kvpilot never downloads" in err


def fake_hub_cache(root: Path, repo: str, commit: str = "c0ffee" * 6 + "c0ff") -> Path:
    """Lays a tiny checkpoint out as huggingface_hub's cache does; gives the snapshot dir."""
    model_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = model_dir / "snapshots" / commit
    write_checkpoint(root / "src", "llama").rename(snapshot.parent.mkdir(parents=True) or snapshot)
    (model_dir / "refs").mkdir()
    (model_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_resolves_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    engine = LLMEngine.from_engine_args(EngineArgs(model="acme/tiny-llama", device="cpu",
                                                   num_kv_blocks=32))
    assert engine.engine_args.model == str(snapshot)
    assert engine.engine_args.name == "acme/tiny-llama"  # what clients send
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the same cache
    engine = LLMEngine.from_engine_args(EngineArgs(model="acme/tiny-llama", device="cpu",
                                                   num_kv_blocks=32))
    assert engine.engine_args.model == str(snapshot)


def test_chat_templates_from_a_file_or_inline(tmp_path: Path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template does not compile"):
        read_chat_template("{% for m in messages %}")


def test_start_up_logs_every_phase(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", device="cpu",
                                                       num_kv_blocks=64))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvpilot.engine"]
    assert isinstance(engine.runner, ModelRunner)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    assert lines[0] == ("loading model tiny-llama (LlamaForCausalLM, 2 layers) as tiny-llama, "
                        "dtype float32, on cpu")
    assert lines[1] == ("topology: tensor_parallel_size=1 pipeline_parallel_size=1 "
                        "expert_parallel_size=1: one rank")
    assert lines[2].startswith(f"weights: {weight_bytes} bytes (0.00 GiB, dummy) loaded in ")
    per_block = engine.runner.bytes_per_block
    assert lines[3] == (f"KV cache: 64 blocks x 16 tokens = 1024 tokens, "
                        f"{64 * per_block / 2**30:.2f} GiB (sized by --num-kv-blocks 64)")
    assert lines[4] == "CUDA graphs: none (CPU)"
    assert lines[5] == ("warm-up: skipped (a CPU engine compiles nothing: --warmup on runs it "
                        "anyway)")
    assert lines[6].startswith("engine ready in ") and lines[6].endswith(
        "max_model_len=4096, max_num_seqs=256")


@pytest.mark.parametrize(("topology", "expected"), [
    ((1, 1, 1, 1, 0), "tensor_parallel_size=1 pipeline_parallel_size=1 expert_parallel_size=1: "
                      "one rank"),
    ((4, 1, 1, 1, 0), "tensor_parallel_size=4 pipeline_parallel_size=1 expert_parallel_size=1: "
                      "4 ranks, 4 per node on 1 node"),
    ((8, 1, 1, 2, 0), "tensor_parallel_size=8 pipeline_parallel_size=1 expert_parallel_size=1: "
                      "8 ranks, 4 per node on 2 nodes"),
    ((2, 1, 1, 1, 8), "tensor_parallel_size=2 pipeline_parallel_size=1 expert_parallel_size=1: "
                      "2 ranks, 2 per node on 1 node; each rank holds a 1/2 slice of all 8 "
                      "experts"),
    ((4, 1, 4, 1, 8), "tensor_parallel_size=4 pipeline_parallel_size=1 expert_parallel_size=4: "
                      "4 ranks, 4 per node on 1 node; each rank holds 2 of 8 experts whole"),
    ((1, 1, 1, 1, 8), "tensor_parallel_size=1 pipeline_parallel_size=1 expert_parallel_size=1: "
                      "one rank"),
])
def test_the_topology_line_says_how_ranks_and_experts_are_laid_out(
        caplog: pytest.LogCaptureFixture, topology, expected):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        log_topology(*topology)
    assert caplog.records[-1].getMessage() == f"topology: {expected}"


def test_sizes_are_per_rank_with_tensor_parallelism(caplog: pytest.LogCaptureFixture):
    report = LoadReport(weight_bytes=2**30, load_seconds=1.5, num_blocks=100, block_size=16,
                        bytes_per_block=2**20, graph_sizes=(1, 2, 4), graph_seconds=0.25)
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        log_load(report, "safetensors", "--num-kv-blocks 100", "-", world_size=2)
    assert [r.getMessage() for r in caplog.records] == [
        "weights: 1073741824 bytes (1.00 GiB, safetensors) per rank (rank 0 of 2) loaded in 1.50s",
        "KV cache: 100 blocks x 16 tokens = 1600 tokens, 0.10 GiB per rank (rank 0 of 2) "
        "(sized by --num-kv-blocks 100)",
        "CUDA graphs: captured 3 decode batch sizes (1..4) (mixed steps eager) per rank "
        "(rank 0 of 2) in 0.25s",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch):
    terminal, pipe = _Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress([1, 2, 3], 3, "loading safetensors shards")) == [1, 2, 3]
    assert "loading safetensors shards:   0%|" in terminal.getvalue()  # the bar was drawn
    monkeypatch.setattr(sys, "stderr", pipe)
    assert list(progress([1, 2, 3], 3, "loading safetensors shards")) == [1, 2, 3]
    assert pipe.getvalue() == ""


def test_serve_positional_with_a_chat_template_logs_then_listens(tmp_path: Path):
    template = tmp_path / "plain.jinja"
    template.write_text("USER: {% for m in messages %}{{ m.content }}{% endfor %}")
    log = tmp_path / "serve.log"
    proc, base = start_server(log, extra=("--chat-template", str(template)))
    try:
        text = log.read_text()
        order = [text.index(s) for s in ("loading model tiny-llama", "topology: ", "weights: ",
                                         "KV cache: ", "CUDA graphs: ", "engine ready in ",
                                         "listening on")]
        assert order == sorted(order)  # nothing listens (no /health, no /ready) while loading
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        body = {"model": "tiny-llama", "max_tokens": 1,
                "messages": [{"role": "user", "content": "hello there"}]}
        usage = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        # The server encodes a rendered chat as is: the template owns the special tokens.
        assert usage["prompt_tokens"] == len(load_tokenizer("tiny-llama").encode(
            "USER: hello there", add_special_tokens=False))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert subprocess.run([sys.executable, "-m", "kvpilot.cli", "serve", "--help"],
                          capture_output=True, text=True, timeout=60).stdout.count("MODEL") >= 1


def one_line_exit_2(command: list[str]) -> str:
    """Runs `kvpilot COMMAND...` expecting exit 2 and no traceback; gives its last stderr
    line (a start-up warning may come before it)."""
    done = subprocess.run([sys.executable, "-m", "kvpilot.cli", *command], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", [["serve", "tiny-llama", "--device", "cpu"],
                                     ["route", "--instances", "http://127.0.0.1:9"]])
def test_a_busy_port_is_one_line_exit_2(command: list[str]):
    """It printed a 14-line traceback (issue 49)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        line = one_line_exit_2([*command, "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in line and "pick another --port" in line


@pytest.mark.parametrize("command", [["serve", "tiny-llama", "--device", "cpu"],
                                     ["route", "--instances", "http://127.0.0.1:9"]])
def test_an_unreadable_secret_file_is_one_line_exit_2(tmp_path: Path, command: list[str]):
    """A directory is unreadable as a file even to root."""
    line = one_line_exit_2([*command, "--fleet-secret-file", str(tmp_path)])
    assert "--fleet-secret-file" in line or str(tmp_path) in line


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_kv_role_without_a_fleet_secret_refuses_to_start(role: str):
    """It ran open to anyone computing an HMAC with the empty key (issue 49)."""
    line = one_line_exit_2(["serve", "tiny-llama", "--device", "cpu", "--role", role,
                            "--port", "0"])
    assert f"--role {role} without --fleet-secret-file" in line and "--insecure-kv" in line


def test_kv_events_are_closed_without_a_fleet_secret(tmp_path: Path):
    """`kvpilot serve` without --fleet-secret-file served /kv_events (block hashes) to anyone."""
    proc, base = start_server(tmp_path / "serve.log")
    try:
        answer = httpx.get(f"{base}/kv_events", timeout=30)
        assert answer.status_code == 401 and "--insecure-kv" in answer.text
    finally:
        proc.terminate()
        proc.wait(30)
    proc, base = start_server(tmp_path / "open.log", extra=("--insecure-kv",))
    try:
        assert httpx.get(f"{base}/kv_events", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
