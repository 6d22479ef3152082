"""Prompts to send, their lengths in tokens of the served model's tokenizer, as `vllm bench serve`:
random prompts, prompts sharing a few prefixes, or a ShareGPT-format conversation file.

Random text is drawn from a fixed word list and cut to the asked number of tokens (encode,
keep the first N ids, decode), so the load generator needs a tokenizer but no torch. The
word-count dataset (`random_word_dataset`) remains for the bench/ scripts whose recorded
results were made in words. `DatasetSpec` is what `--dataset-name` and its flags resolve to,
shared by `kvpilot bench serve` and `kvpilot bench throughput`; importing this module loads
no tokenizer (so `--help` stays light).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.contracts.tokenizer import TokenizerLike

DATASETS = ("random", "shared-prefix", "sharegpt")
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "first", "one", "their", "its", "new", "after", "who", "they", "two", "her", "she", "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up", "such", "used", "many", "can", "state", "about", "national", "out", "known", "university", "united", "then", "made", "river", "north", "south", "east", "west", "light", "water", "stone", "paper", "music", "garden", "window", "market", "bridge", "signal", "engine", "cache", "block", "token", "prefix", "queue", "batch", "model", "kernel", "tensor", "router", "replica"]
# ShareGPT filtering as vLLM's: too short to time, or too long for common context sizes.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark: its prompt, its length, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    """Tokens of the prompt without special tokens (words, for random_word_dataset)."""
    output_len: int


@dataclass(frozen=True)
class DatasetSpec:
    """The requests a benchmark asks for: `--dataset-name` and the flags that shape it."""

    name: str
    num_prompts: int
    input_len: int
    output_len: int | None
    """Output tokens per request; None: each ShareGPT reply's own length (sharegpt only)."""
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 256
    path: Path | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset_name={self.name!r} is unknown: pass --dataset-name "
                             f"{' or '.join(DATASETS)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts} is invalid: pass --num-prompts 1 "
                             "or more")
        if self.name == "sharegpt" and self.path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (ShareGPT JSON)")
        if self.name != "sharegpt" and self.output_len is None:
            raise ValueError(f"--dataset-name {self.name} needs an output length: pass "
                             "--output-len")
        _check_ratio(self.range_ratio)


def sample_requests(spec: DatasetSpec, tokenizer: TokenizerLike) -> list[SampleRequest]:
    """Gives the requests `spec` asks for, their lengths in `tokenizer`'s tokens."""
    if spec.name == "sharegpt":
        assert spec.path is not None  # DatasetSpec refuses sharegpt without a path
        return sharegpt_dataset(spec.path, spec.num_prompts, spec.seed, tokenizer,
                                spec.output_len)
    assert spec.output_len is not None  # DatasetSpec refuses a random dataset without one
    if spec.name == "shared-prefix":
        return shared_prefix_dataset(spec.num_prompts, spec.num_prefixes, spec.prefix_len,
                                     spec.input_len, spec.output_len, spec.range_ratio,
                                     spec.seed, tokenizer)
    return random_dataset(spec.num_prompts, spec.input_len, spec.output_len, spec.range_ratio,
                          spec.seed, tokenizer)


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    # Uniform in [mean * (1 - r), mean * (1 + r)], as vLLM's random dataset does.
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _check_ratio(range_ratio: float) -> None:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} is invalid: must be in [0, 1)")


def _token_ids(rng: random.Random, tokenizer: TokenizerLike, count: int) -> list[int]:
    """Gives the ids of `count` tokens of random text (every word is at least one token)."""
    ids: list[int] = []
    words = count
    for _ in range(8):  # one pass suffices unless a tokenizer merges across spaces
        ids = tokenizer.encode(_words(rng, words), add_special_tokens=False)
        if len(ids) >= count:
            break
        words *= 2
    return ids[:count]


def _tokens(rng: random.Random, tokenizer: TokenizerLike, count: int) -> str:
    """Gives random text of `count` tokens."""
    return tokenizer.decode(_token_ids(rng, tokenizer, count))


def _length(tokenizer: TokenizerLike, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int, tokenizer: TokenizerLike) -> list[SampleRequest]:
    """Gives `num_prompts` requests of about `input_len` prompt tokens and `output_len` output
    tokens (each uniform within `range_ratio`)."""
    _check_ratio(range_ratio)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        text = _tokens(rng, tokenizer, _lengths(rng, input_len, range_ratio))
        out.append(SampleRequest(text, _length(tokenizer, text),
                                 _lengths(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(num_prompts: int, num_prefixes: int, prefix_len: int,
                          input_len: int, output_len: int, range_ratio: float,
                          seed: int, tokenizer: TokenizerLike) -> list[SampleRequest]:
    """Gives requests whose prompts start with one of `num_prefixes` shared prefixes.

    Request i uses prefix i mod num_prefixes (`prefix_len` tokens) followed by its own random
    suffix of about `input_len` tokens, so a prefix-caching server reuses the prefix's blocks.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes={num_prefixes} is invalid: must be at least 1")
    _check_ratio(range_ratio)
    rng = random.Random(seed)
    prefixes = [_tokens(rng, tokenizer, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        suffix = _tokens(rng, tokenizer, _lengths(rng, input_len, range_ratio))
        prompt = f"{prefixes[i % num_prefixes]} {suffix}".strip()
        out.append(SampleRequest(prompt, _length(tokenizer, prompt),
                                 _lengths(rng, output_len, range_ratio)))
    return out


def sharegpt_dataset(path: Path, num_prompts: int, seed: int, tokenizer: TokenizerLike,
                     output_len: int | None = None) -> list[SampleRequest]:
    """Gives up to `num_prompts` requests from a ShareGPT-format JSON file: each conversation's
    first turn is the prompt, the second's length the output length (or `output_len`);
    conversations are shuffled with `seed` and filtered as vLLM does (each side at least 4
    tokens, the prompt at most 1024, both at most 2048)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path={str(path)!r} is not a readable JSON file: {exc}") \
            from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path={str(path)!r} is not ShareGPT format: expected a "
                         'list of {"conversations": [{"from": ..., "value": ...}, ...]}')
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        prompt_len = _length(tokenizer, prompt)
        want = output_len if output_len is not None else _length(tokenizer, completion)
        if prompt_len < SHAREGPT_MIN_LEN or want < SHAREGPT_MIN_LEN or \
                prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + want > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, prompt_len, want))
    if not out:
        raise ValueError(f"--dataset-path={str(path)!r} has no conversation with two turns "
                         "of 4 to 1024 tokens each (2048 together)")
    return out


def random_word_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                        seed: int) -> list[SampleRequest]:
    """Gives `num_prompts` requests of about `input_len` words (no tokenizer needed) and
    `output_len` tokens; `prompt_len` counts words."""
    _check_ratio(range_ratio)
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = _lengths(rng, input_len, range_ratio)
        out.append(SampleRequest(_words(rng, n_in), n_in, _lengths(rng, output_len, range_ratio)))
    return out


def random_token_prompts(num_prompts: int, input_len: int, seed: int,
                         tokenizer: TokenizerLike) -> list[list[int]]:
    """Gives `num_prompts` prompts of exactly `input_len` token ids of random text (no special
    tokens), for timing a batch of known shape."""
    rng = random.Random(seed)
    return [_token_ids(rng, tokenizer, input_len) for _ in range(num_prompts)]
