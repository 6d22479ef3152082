"""`kvpilot bench throughput` and `kvpilot bench latency` on the tiny model: their JSON holds
the tokens the engine really saw and generated, and bad flags end in exit code 2."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvpilot.cli.main import main
from kvpilot.engine.benchmarks.offline_engine import generate
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.loadgen.datasets import DatasetSpec, random_dataset, sharegpt_dataset

TOKENIZER = load_tokenizer("tiny-llama")
ENGINE = ["--model", "tiny-llama", "--num-kv-blocks", "64", "--disable-tqdm"]


def _sharegpt(path: Path) -> Path:
    reply = "the river runs north past the old stone bridge"
    path.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": f"tell me about the market and the city number {i}"},
        {"from": "gpt", "value": reply}]} for i in range(5)]))
    return path


@pytest.mark.parametrize("dataset", ["random", "sharegpt"])
def test_throughput_counts_the_tokens_of_every_request(tmp_path: Path, dataset: str,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    out = tmp_path / "throughput.json"
    data = ["--dataset-name", dataset]
    if dataset == "sharegpt":
        data += ["--dataset-path", str(_sharegpt(tmp_path / "sharegpt.json"))]
        samples = sharegpt_dataset(tmp_path / "sharegpt.json", 4, 0, TOKENIZER, 6)
    else:
        samples = random_dataset(4, 12, 6, 0.0, 0, TOKENIZER)
    code = main(["bench", "throughput", *data, "--num-prompts", "4", "--input-len", "12",
                 "--output-len", "6", "--n", "2", "--output-json", str(out), *ENGINE])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4
    # the engine's prompts carry BOS; every one of the n=2 completions runs to 6 tokens
    assert result["num_prompt_tokens"] == sum(len(TOKENIZER.encode(s.prompt)) for s in samples)
    assert result["num_output_tokens"] == 4 * 2 * 6
    assert result["total_num_tokens"] == result["num_prompt_tokens"] + 48
    elapsed = result["elapsed_time"]
    assert result["requests_per_second"] == pytest.approx(4 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(48 / elapsed)
    assert (result["dataset_name"], result["engine_args"]["num_kv_blocks"]) == (dataset, 64)
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "Total num output tokens:  48" in printed


def test_latency_times_every_iteration(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latency.json"
    code = main(["bench", "latency", "--batch-size", "3", "--input-len", "8", "--output-len",
                 "4", "--num-iters-warmup", "1", "--num-iters", "4", "--output-json", str(out),
                 *ENGINE])
    assert code == 0
    result = json.loads(out.read_text())
    latencies = result["latencies"]
    assert len(latencies) == 4 and all(t > 0 for t in latencies)
    assert result["avg_latency"] == pytest.approx(statistics.fmean(latencies))
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert result["percentiles"]["50"] == pytest.approx(statistics.median(latencies))
    assert min(latencies) <= result["percentiles"]["10"] <= result["percentiles"]["99"] \
        <= max(latencies)
    # token-id prompts of exactly --input-len, each run to --output-len
    assert (result["num_prompt_tokens"], result["num_output_tokens"]) == (3 * 8, 3 * 4)
    assert "50% percentile latency" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["throughput", "--num-prompts", "0"], "num_prompts=0 is invalid: pass --num-prompts 1"),
    (["throughput", "--output-len", "0"], "output_len=0 is invalid: pass --output-len 1"),
    (["throughput", "--dataset-name", "sharegpt"], "needs --dataset-path FILE"),
    (["throughput", "--random-range-ratio", "1.5"], "random_range_ratio=1.5 is invalid"),
    (["latency", "--batch-size", "0"], "batch_size=0 is invalid: pass --batch-size 1"),
    (["latency", "--num-iters-warmup", "-1"], "pass --num-iters-warmup 0 or more"),
    (["latency", "--n", "0"], "n=0 is invalid: pass --n 1"),
])
def test_bad_flags_name_the_fix(argv: list[str], message: str,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, *ENGINE]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency"]) == 2
    assert "`kvpilot bench latency --model tiny-llama`" in capsys.readouterr().err


def test_dataset_spec_refuses_a_random_dataset_without_an_output_length() -> None:
    with pytest.raises(ValueError, match="--dataset-name random needs an output length"):
        DatasetSpec("random", 4, 12, None)


class _LLMWithBar:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def generate(self, prompts: list[str], params: SamplingParams,
                 use_tqdm: bool = True) -> list[Any]:
        self.calls.append({"prompts": prompts, "use_tqdm": use_tqdm})
        return []


@pytest.mark.parametrize("use_tqdm", [True, False])
def test_generate_hands_the_progress_bar_flag_to_the_llm(use_tqdm: bool) -> None:
    llm = _LLMWithBar()
    generate(llm, ["a"], SamplingParams(), use_tqdm)  # pyright: ignore[reportArgumentType]
    assert llm.calls == [{"prompts": ["a"], "use_tqdm": use_tqdm}]
