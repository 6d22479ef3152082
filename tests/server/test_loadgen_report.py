"""The load generator's pure parts: report on fixed timings, SLO parsing, pacing and datasets."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.loadgen.datasets import (
    WORDS,
    random_dataset,
    random_word_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from kvpilot.engine.loadgen.report import (
    RequestResult,
    format_table,
    meets_slos,
    parse_slos,
    percentile,
    summarize,
)
from kvpilot.engine.loadgen.runner import send_offsets

# Three successes and a failure over 2 s, timings in seconds.
RESULTS = [
    RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.10, itl=[0.02] * 4,
                  latency=0.18),
    RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.30, itl=[0.05, 0.05],
                  latency=0.40),
    RequestResult(True, prompt_tokens=30, output_tokens=1, ttft=0.20, itl=[], latency=0.20),
    RequestResult(False, error="HTTP 503: draining"),
]


def test_summary_of_fixed_timings() -> None:
    s = summarize(RESULTS, duration=2.0, slos={"ttft": 250, "tpot": 30})
    expected = {
        "completed": 3, "failed": 1, "total_input_tokens": 60, "total_output_tokens": 9,
        "request_throughput": 1.5, "output_throughput": 4.5, "total_token_throughput": 34.5,
        # ttft: 100, 300, 200 ms
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "p99_ttft_ms": 298.0,
        # tpot: (0.18-0.10)/4 = 20 ms and (0.40-0.30)/2 = 50 ms; one-token request excluded
        "mean_tpot_ms": 35.0, "median_tpot_ms": 35.0,
        # itl: four of 20 ms and two of 50 ms
        "mean_itl_ms": 30.0, "median_itl_ms": 20.0,
        "mean_e2el_ms": 260.0, "median_e2el_ms": 200.0,
        # goodput: the first and the one-token request meet ttft <= 250 and tpot <= 30
        "request_goodput": 1.0,
        "errors": ["HTTP 503: draining"],
    }
    for key, value in expected.items():
        assert s[key] == pytest.approx(value), key
    assert "Request goodput (req/s):" in format_table(s)
    assert "Mean TTFT (ms):" in format_table(s)


@pytest.mark.parametrize(("values", "p", "expected"), [
    ([], 50, 0.0), ([5.0], 99, 5.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 100, 4.0), ([3.0, 1.0, 2.0], 0, 1.0), ([0.0, 10.0], 90, 9.0)])
def test_percentile_interpolates_like_numpy(values: list[float], p: float,
                                            expected: float) -> None:
    assert percentile(values, p) == pytest.approx(expected)


@pytest.mark.parametrize(("items", "expected"), [
    (None, {}), (["ttft:500"], {"ttft": 500.0}),
    (["ttft:500", "tpot:50", "e2el:2000"], {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0})])
def test_parse_slos(items: list[str] | None, expected: dict[str, float]) -> None:
    assert parse_slos(items) == expected


@pytest.mark.parametrize("item", ["ttft", "latency:5", "ttft:fast", "tpot:0"])
def test_parse_slos_rejects_naming_the_flag(item: str) -> None:
    with pytest.raises(ValueError, match="goodput="):
        parse_slos([item])


def test_failed_request_never_meets_slos() -> None:
    assert not meets_slos(RESULTS[3], {"ttft": 1e9})
    assert meets_slos(RESULTS[0], {})


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(0, 1e6), min_size=1, max_size=50),
       p=st.floats(0, 100))
def test_percentile_stays_within_range_and_is_monotonic(values: list[float], p: float) -> None:
    got = percentile(values, p)
    assert min(values) - 1e-6 <= got <= max(values) + 1e-6
    assert percentile(values, min(100.0, p + 1)) >= got - 1e-6


@pytest.mark.parametrize(("rate", "burstiness"), [(10.0, 1.0), (50.0, 0.5), (5.0, 4.0)])
def test_send_offsets_have_mean_gap_one_over_rate(rate: float, burstiness: float) -> None:
    offsets = send_offsets(4000, rate, burstiness, seed=3)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert mean_gap == pytest.approx(1 / rate, rel=0.1)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert send_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        send_offsets(5, 0.0, 1.0, seed=0)


TOKENIZER = load_tokenizer("tiny-llama")


def tokens(text: str) -> int:
    return len(TOKENIZER.encode(text, add_special_tokens=False))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), input_len=st.integers(1, 80), output_len=st.integers(1, 50),
       ratio=st.floats(0, 0.9), seed=st.integers(0, 2**16))
def test_random_dataset_lengths_are_tokens_in_range(n: int, input_len: int, output_len: int,
                                                    ratio: float, seed: int) -> None:
    samples = random_dataset(n, input_len, output_len, ratio, seed, TOKENIZER)
    assert len(samples) == n
    assert samples == random_dataset(n, input_len, output_len, ratio, seed, TOKENIZER)
    for s in samples:
        assert s.prompt_len == tokens(s.prompt)  # the length is what the tokenizer counts
        assert max(1, int(input_len * (1 - ratio))) <= s.prompt_len
        assert s.prompt_len <= max(1, int(input_len * (1 + ratio)))
        assert 1 <= s.output_len <= max(1, int(output_len * (1 + ratio)))


def test_word_dataset_counts_words_for_the_recorded_benchmarks() -> None:
    samples = random_word_dataset(5, 12, 4, 0.0, 3)
    assert all(len(s.prompt.split()) == s.prompt_len == 12 for s in samples)
    assert all(set(s.prompt.split()) <= set(WORDS) for s in samples)


def test_shared_prefix_dataset_cycles_its_prefixes() -> None:
    samples = shared_prefix_dataset(9, num_prefixes=3, prefix_len=12, input_len=4,
                                    output_len=8, range_ratio=0.0, seed=1, tokenizer=TOKENIZER)
    heads = [TOKENIZER.decode(TOKENIZER.encode(s.prompt, add_special_tokens=False)[:12])
             for s in samples]
    assert len(set(heads)) == 3
    assert all(heads[i] == heads[i % 3] for i in range(9))
    assert all(s.prompt_len == tokens(s.prompt) and 15 <= s.prompt_len <= 17 for s in samples)
    assert all(s.output_len == 8 for s in samples)
    with pytest.raises(ValueError, match="num_prefixes"):
        shared_prefix_dataset(1, 0, 4, 4, 4, 0.0, 0, TOKENIZER)


def conversation(human: str, gpt: str) -> dict[str, Any]:
    return {"id": "x", "conversations": [{"from": "human", "value": human},
                                         {"from": "gpt", "value": gpt}]}


LONG = " ".join(["token"] * 1100)


def test_sharegpt_takes_first_turns_and_filters_like_vllm(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        conversation("tell me about the river and the bridge", "the river runs north"),
        conversation("hi", "the river runs north"),  # prompt under 4 tokens
        conversation("tell me about the river and the bridge", "ok"),  # reply under 4
        conversation(LONG, "the river runs north"),  # prompt over 1024
        {"id": "one turn", "conversations": [{"from": "human", "value": "alone"}]},
        conversation("what is a kernel and a tensor", "a tensor of kernels in a queue"),
    ]))
    samples = sharegpt_dataset(path, 10, 0, TOKENIZER)
    assert sorted(s.prompt for s in samples) == ["tell me about the river and the bridge",
                                                 "what is a kernel and a tensor"]
    by_prompt = {s.prompt: s for s in samples}
    first = by_prompt["tell me about the river and the bridge"]
    assert (first.prompt_len, first.output_len) == (
        tokens(first.prompt), tokens("the river runs north"))
    # A fixed output length makes the short reply usable, as in vLLM.
    assert [s.output_len for s in sharegpt_dataset(path, 10, 0, TOKENIZER, 7)] == [7, 7, 7]
    assert len(sharegpt_dataset(path, 1, 0, TOKENIZER)) == 1
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="is not ShareGPT format"):
        sharegpt_dataset(path, 10, 0, TOKENIZER)


def test_loadgen_and_serve_cli_stay_torch_free() -> None:
    # The load generator runs in the router image, which has no torch.
    code = ("import sys, kvpilot.engine.loadgen.runner, kvpilot.engine.loadgen.cli, "
            "kvpilot.engine.loadgen.report, kvpilot.engine.server.cli; "
            "print(sorted(m for m in ('torch', 'uvicorn', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
