"""bench/structured_gpu.py end to end on CPU (its smoke mode): the four modes, the slowdowns,
the mask fill's cost and the constrained outputs' validation are written to results.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_structured_bench_smoke(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "structured_gpu.py"),
                           str(tmp_path), "--smoke"], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["unconstrained", "unconstrained_sync",
                                                   "json_schema", "unconstrained_matched"]
    assert all(r["pure_decode_steps"] > 0 and r["output_tok_per_s"] > 0 for r in result["rows"])
    # CPU captures no graphs: every step is eager
    assert all(r["eager_step_ms_mean"] > 0 for r in result["rows"])
    assert result["valid_outputs_of_8"] == 8
    assert result["slowdown_decode_step"] > 0
    by_mode = {r["mode"]: r for r in result["rows"]}
    # the matched run's requests end at the lengths the constrained ones ended at
    constrained = by_mode["json_schema"]["output_lengths"]
    matched = by_mode["unconstrained_matched"]["output_lengths"]
    assert constrained and matched and set(matched) <= set(constrained)
    assert result["slowdown_tok_per_s_matched"] > 0
    assert result["slowdown_tok_per_s_matched_rounds"] == [result["slowdown_tok_per_s_matched"]]
    assert by_mode["json_schema"]["grammar_fill_ms_median"] > 0
    assert by_mode["unconstrained"]["grammar_fill_ms_median"] == 0
    fill = result["mask_fill"]
    assert fill["steps"] == 6 and all(fill[f"{name}_ms_median"] > 0 for name in (
        "serial", "serial_max_row", "parallel", "parallel_cpu", "parallel_copies"))
    assert fill["fill_threads"] == max(1, min(fill["cpus"] - 1, 32))


def test_synthetic_tokenizer_is_a_loadable_byte_level_bpe(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from structured_gpu import synthetic_tokenizer
    finally:
        sys.path.remove(str(REPO / "bench"))
    from tokenizers import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(synthetic_tokenizer(4096)))
    tok = Tokenizer.from_file(str(path))
    assert tok.get_vocab_size() == 4096
    text = '{"name": "Zoë", "zip": "12345"}'
    assert tok.decode(tok.encode(text).ids) == text


def test_synthetic_token_lengths_are_those_of_a_real_vocabulary() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from structured_gpu import _byte_alphabet, synthetic_tokenizer
    finally:
        sys.path.remove(str(REPO / "bench"))
    byte_of = {char: byte for byte, char in _byte_alphabet().items()}
    lengths = [len(token) for token in synthetic_tokenizer(20000)["model"]["vocab"]]
    assert all(len(token) == len(bytes(byte_of[c] for c in token))
               for token in list(synthetic_tokenizer(300)["model"]["vocab"])[256:])
    # cl100k_base: mean 6.4 bytes, 8.6% over 10 (the old synthetic one: 10.9, 59%)
    assert 5.5 < sum(lengths) / len(lengths) < 7.5
    assert sum(n > 10 for n in lengths) / len(lengths) < 0.15
