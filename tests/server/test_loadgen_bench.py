"""`kvpilot bench serve` end to end against a real tiny-llama server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_harness import MODEL, RunningServer

from kvpilot.cli.main import main
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
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_counts_refused_requests_as_failed(server: RunningServer,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.base_url, "--model", "wrong-model",
                 "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "2",
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
