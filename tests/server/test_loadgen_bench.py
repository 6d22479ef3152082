"""`kvpilot bench serve` end to end against a real tiny-llama server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from server_harness import MODEL, RunningServer

from kvpilot.cli.main import main
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.loadgen import cli
from kvpilot.engine.loadgen.runner import carries_tokens


@pytest.mark.parametrize(("dataset", "extra"), [
    ("random", ["--request-rate", "inf", "--max-concurrency", "4"]),
    ("shared-prefix", ["--request-rate", "40", "--num-prefixes", "2", "--prefix-len", "20"]),
    ("random", ["--endpoint", "/v1/chat/completions", "--burstiness", "0.5",
                "--request-rate", "40"]),
])
def test_bench_serve_reports_every_request(server: RunningServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], dataset: str,
                                           extra: list[str]) -> None:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL,
                 "--dataset", dataset, "--num-prompts", "8", "--random-input-len", "12",
                 "--random-output-len", "6", "--ignore-eos", "--goodput", "ttft:60000",
                 "--result-json", str(out), "--seed", "1", *extra])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6  # ignore_eos: every request runs to length
    assert result["total_input_tokens"] >= 8 * 12
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["median_itl_ms"] > 0
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert "requests: 100%" in captured.err and "8/8" in captured.err  # the progress bar


def test_random_prompts_are_exactly_the_asked_tokens(server: RunningServer, tmp_path: Path):
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL,
                 "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "40",
                 "--random-output-len", "2", "--ignore-eos", "--disable-tqdm",
                 "--result-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    # 40 prompt tokens, plus the BOS the server's tokenizer adds, as the server counts them.
    assert result["total_input_tokens"] == 6 * (40 + 1)
    assert result["tokenizer"] == MODEL


def test_sharegpt_file_drives_the_bench(server: RunningServer, tmp_path: Path):
    data = tmp_path / "sharegpt.json"
    replies = ["the river runs north to the sea", "a tensor of kernels in a queue of blocks"]
    data.write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": f"question {i} about it"},
                                         {"from": "gpt", "value": reply}]}
        for i, reply in enumerate(replies)]))
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL,
                 "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts",
                 "5", "--ignore-eos", "--disable-tqdm", "--result-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    tokenizer = load_tokenizer(MODEL)
    assert result["completed"] == 2
    assert result["total_output_tokens"] == sum(
        len(tokenizer.encode(r, add_special_tokens=False)) for r in replies)


def test_the_tokenizer_comes_from_the_server_root_when_the_name_is_not_local(
        server: RunningServer, monkeypatch: pytest.MonkeyPatch):
    args = argparse.Namespace(tokenizer=None, model="chat", base_url=server.base_url,
                              api_key=None)
    monkeypatch.setattr(cli, "_server_root", lambda a: "tiny-llama")
    assert cli.load_bench_tokenizer(args)[1] == "tiny-llama"
    monkeypatch.setattr(cli, "_server_root", lambda a: None)
    with pytest.raises(ValueError, match="pass --tokenizer"):
        cli.load_bench_tokenizer(args)


def test_bench_serve_counts_refused_requests_as_failed(server: RunningServer,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--model", "wrong-model",
                 "--tokenizer", MODEL, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "2",
                 "--result-json", str(out)])
    result = json.loads(out.read_text())
    assert code == 1
    assert result["completed"] == 0 and result["failed"] == 3
    assert any("HTTP 404" in e for e in result["errors"])


@pytest.mark.parametrize(("chunk", "expected"), [
    ({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}, True),
    ({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, False),
    ({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, True),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, False),
    ({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}, True),
    ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, False),
])
def test_only_chunks_with_output_count_as_token_arrivals(chunk: dict, expected: bool) -> None:
    assert carries_tokens(chunk) is expected
