"""Issue 24: does the bench's synthetic tokenizer make llguidance's mask cheaper or dearer
than a real vocabulary? Per-row mask costs, one row at a time, on this CPU.

Walks `--rows` matchers of `structured_gpu.SCHEMA` through random allowed tokens (a
finished one starts again) for `--steps` steps and times each row's mask, for two
vocabularies: the synthetic 151,936-token byte-level BPE that `structured_gpu.py` uses,
and Mistral's Tekken (131,072 ids: 1,000 special, then tiktoken-style BPE ranks), read
from the `mistral_common` wheel's `data/tekken_240911.json` (a PyPI package; nothing is
downloaded at run time):

    pip download --no-deps -d /tmp/mc mistral_common && unzip -o -d /tmp/mc /tmp/mc/*.whl
    python bench/structured_tokenizers.py --tekken /tmp/mc/mistral_common/data/tekken_240911.json

Prints mean, p50, p90, p99 and max microseconds per row for each.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from pathlib import Path

import llguidance
import numpy as np
from structured_gpu import QWEN3_0_6B, SCHEMA, synthetic_tokenizer

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.structured.grammar import grammar_of
from kvpilot.engine.structured.matchers import new_matcher


def tekken(path: Path) -> tuple[llguidance.LLTokenizer, int]:
    """Gives Tekken as an llguidance tokenizer (EOS = id 2, as Mistral's) and its vocab size."""
    body = json.loads(path.read_text())
    config = body["config"]
    specials, size = config["default_num_special_tokens"], config["default_vocab_size"]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] + specials
             for t in body["vocab"][:size - specials]}
    # from_tiktoken is in llguidance's binding, not its stubs (llguidance.tiktoken calls it too)
    return llguidance.LLTokenizer.from_tiktoken(  # pyright: ignore[reportAttributeAccessIssue]
        encoder=ranks, special_tokens={f"<SPECIAL_{i}>": i for i in range(specials)},
        pattern=config["pattern"], eos_token=2, n_vocab=size), size


def synthetic() -> tuple[llguidance.LLTokenizer, int]:
    vocab = QWEN3_0_6B["vocab_size"]
    body = synthetic_tokenizer(vocab)
    return llguidance.LLTokenizer(json.dumps(body), n_vocab=vocab,
                                  eos_token=[body["added_tokens"][2]["id"]]), vocab


def row_costs(tok: llguidance.LLTokenizer, vocab: int, rows: int, steps: int) -> np.ndarray:
    """Gives every row's mask time (s) over the walk."""
    grammar = grammar_of(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    words = (vocab + 31) // 32
    rng = np.random.default_rng(0)
    matchers = [new_matcher(tok, grammar) for _ in range(rows)]
    mask = np.zeros((rows, words), dtype=np.int32)
    costs = []
    for _ in range(steps):
        for row, matcher in enumerate(matchers):
            began = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask[row].ctypes.data, words * 4)
            costs.append(time.perf_counter() - began)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(rows, -1)
        for row in range(rows):
            token = int(rng.choice(np.flatnonzero(bits[row, :vocab])))
            if not matchers[row].consume_token(token):
                raise RuntimeError(f"a matcher refused an allowed token: "
                                   f"{matchers[row].get_error()}")
            if matchers[row].is_stopped():
                matchers[row] = new_matcher(tok, grammar)
    return np.array(costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tekken", type=Path, required=True, help="tekken_240911.json")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    for name, (tok, vocab) in (("synthetic", synthetic()), ("tekken", tekken(args.tekken))):
        us = row_costs(tok, vocab, args.rows, args.steps) * 1e6
        print(f"{name} ({vocab} ids): us per row mean {us.mean():.0f}, p50 {np.median(us):.0f}, "
              f"p90 {np.percentile(us, 90):.0f}, p99 {np.percentile(us, 99):.0f}, "
              f"max {us.max():.0f}", flush=True)


if __name__ == "__main__":
    main()
