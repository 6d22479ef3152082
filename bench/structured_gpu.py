"""Issue 24: the cost of structured outputs at batch 64 (goal: <= 10% slower than unconstrained).

A Qwen3-0.6B-shaped dummy model (bf16, random weights; `--shape 8b`: Llama-3-8B) with a
byte-level BPE tokenizer of the shape's vocabulary size (151,936 ids; 128,256), synthesised here: the 256
byte tokens plus random merges of existing tokens (words, spaces, digits and
JSON punctuation first), so the grammar library walks a token trie of a real
size. A closed loop keeps 64 requests in flight (a finished one is replaced at
once) for a fixed number of steps, in three modes, each its own engine:

- `unconstrained`: the default (async scheduling on CUDA);
- `unconstrained_sync`: async scheduling off, so the gap to `json_schema` is the
  grammar's own cost (constrained steps run synchronously);
- `json_schema`: every request constrained by one schema (objects, enums,
  bounded strings, arrays of numbers), compiled once and copied per request;
- `unconstrained_matched` (after `json_schema`): unconstrained requests whose outputs
  end at the lengths the constrained ones ended at, in turn: the same mix of prefills
  and decodes, so output tok/s compares like with like;
- `json_schema_guidance`: `json_schema` matched by llguidance (`--structured-outputs-backend
  guidance`; `json_schema` runs the default, `auto`: xgrammar for this schema), its ratio
  to the same round's `unconstrained_matched` reported beside `json_schema`'s;
- `json_schema_split`: `json_schema_guidance` with each row's mask filled by `--mask-split`
  parts of the vocabulary (`KVPILOT_MASK_SPLIT`, `structured/vocab_split.py`), reported
  the same way.

`--repeat N` runs the modes N rounds in turn; the matched ratio is given per round and as
their median (the eager steps' host time varies from engine process to process: one
round's ratio moved by +-10% between two runs of the same code, 2026-11-27).

Reported per mode: the median ms of pure decode steps with 64 running (the wall
time of `step()` with no device sync between steps, `closed_loop.py`), and the
output tokens/s over the timed steps. `slowdown` = json_schema / unconstrained.
Per mode also: the median ms of the grammar's mask fill per decode step (the
engine's "grammar" phase, on its background thread), of the engine thread's wait
for it before sampling ("mask_wait": the part of the fill that the step's other
host work and the forward did not hide), and how many timed steps left a batch in flight
(async scheduling kept on). Mixed prefill+decode steps run eagerly (CUDA graphs
hold pure decode batches): constrained requests end with their JSON object
(~100-150 tokens here) and are replaced, so they prefill more often than the
unconstrained ones (256 tokens), hence more eager steps and lower tok/s; the
median decode step compares like with like. A last child times the mask fill
alone (`structured_mask_fill.py`): serially vs llguidance's parallel executor.

    python bench/structured_gpu.py OUT_DIR            # CUDA
    python bench/structured_gpu.py OUT_DIR --shape 8b # CUDA, Llama-3-8B shape
    python bench/structured_gpu.py OUT_DIR --smoke    # CPU, tiny-qwen3, a few steps
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from closed_loop import closed_loop
from cpu_smoke import one_thread_per_process
from fresh_process import call_in_fresh_process
from shapes import LLAMA3_8B, QWEN3_0_6B

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "kind", "scores", "address", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["person", "company", "place"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["street", "zip"],
                    "properties": {"street": {"type": "string", "maxLength": 60},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                 "maxItems": 6},
    },
}
MODES = ("unconstrained", "unconstrained_sync", "json_schema", "unconstrained_matched")
GUIDANCE_MODE = "json_schema_guidance"  # json_schema matched by llguidance
SPLIT_MODE = "json_schema_split"  # llguidance with the vocabulary split (--mask-split)


def _byte_alphabet() -> dict[int, str]:
    """Gives GPT-2's byte -> printable character map (byte-level BPE's vocabulary strings)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


# how many tokens of cl100k_base (a byte-level BPE vocabulary of 100k) have 2, 3, ... 16
# bytes: most are 3-8 bytes long (mean 6.4), under 9% longer than 10, under 1% longer than 16
_REAL_LENGTHS = {2: 3830, 3: 11939, 4: 15057, 5: 14792, 6: 13100, 7: 11504, 8: 9213,
                 9: 7026, 10: 4918, 11: 3307, 12: 2063, 13: 1160, 14: 700, 15: 361, 16: 225}


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> dict:
    """Gives a tokenizer.json: byte-level BPE with `vocab_size - 3` tokens from random merges
    and three special tokens at the top (<|endoftext|>, <|im_start|>, <|im_end|>).

    As in real vocabularies, tokens are mostly whole UTF-8 text (about 3% end in a partial
    multi-byte character), words of letters and digits, many with a leading space, and their
    byte lengths follow a real vocabulary's (`_REAL_LENGTHS`): merging random bytes instead
    gave 85% invalid UTF-8, which no JSON string admits and which llguidance's precomputed
    string slices skip; merging random tokens gave a mean of 11 bytes (59% over 10), which
    llguidance's 10-byte string slice misses and whose trie is deeper: ms per row where a
    real vocabulary costs tens of us.
    """
    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {alphabet[b]: b for b in range(256)}
    merges: list[list[str]] = []
    space = alphabet[ord(" ")]
    # whole UTF-8 pieces by byte length: any text, words (letters, digits), words after a space
    text: dict[int, list[str]] = {n: [] for n in range(1, 17)}
    words: dict[int, list[str]] = {n: [] for n in range(1, 17)}
    spaced: dict[int, list[str]] = {n: [] for n in range(1, 17)}
    for b in range(32, 127):
        text[1].append(alphabet[b])
        if chr(b).isalnum():
            words[1].append(alphabet[b])
    for char in "éèêëàâäçñöøüßåæœíóúãõ€£¥°±×÷中文日本語한국어привеΑΒΓλμπ":  # as byte merges
        left, *rest = [alphabet[b] for b in char.encode()]
        for right in rest:
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append([left, right])
            left += right
        text[len(left)].append(left)
    partial = [alphabet[b] for b in range(0xC3, 0xF0)]  # lead bytes of multi-byte characters
    lengths, weights = list(_REAL_LENGTHS), list(_REAL_LENGTHS.values())
    target = vocab_size - 3
    while len(vocab) < target:
        n = rng.choices(lengths, weights)[0]
        kind = rng.random()
        if kind < 0.03:  # a piece and the lead byte of a character it does not finish
            pool, left, right = None, rng.choice(text[n - 1] or text[1]), rng.choice(partial)
        elif kind < 0.18:  # a word after a space
            pool, left, right = spaced, space, rng.choice(words[n - 1] or words[1])
        else:  # two words (the first maybe after a space), or any two pieces of text
            pool = (spaced if rng.random() < 0.5 else words) if kind < 0.78 else text
            split = rng.randrange(1, n)
            lefts, rights = pool[split], (words if pool is spaced else pool)[n - split]
            if not lefts or not rights:
                continue
            left, right = rng.choice(lefts), rng.choice(rights)
        token = left + right
        if token in vocab:
            continue
        vocab[token] = len(vocab)
        merges.append([left, right])
        if pool is not None:
            pool[len(token)].append(token)
            if pool is not text:
                text[len(token)].append(token)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [{"id": target + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, s in enumerate(specials)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


SHAPES = {"0.6b": QWEN3_0_6B, "8b": LLAMA3_8B}


def model_dir(root: Path, shape: str = "0.6b") -> Path:
    """Gives a model dir: the shape's config (its eos the synthetic <|im_end|>) and a
    synthetic tokenizer of the shape's vocabulary size (Qwen3's 151,936; Llama 3's 128,256)."""
    path = root / f"{shape}-shape"
    path.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[shape]["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab)
    eos = tokenizer["added_tokens"][2]["id"]
    config = {**SHAPES[shape], "eos_token_id": eos, "bos_token_id": eos - 2}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path


def run_mode(model: str, mode: str, smoke: bool, fill_threads: int | None = None,
             lengths: list[int] | None = None, mask_split: int = 1) -> dict:
    """Gives one mode's numbers: a closed loop of `batch` requests for the timed steps;
    `fill_threads` replaces the engine's mask-fill thread count (CPUs - 1) in this process;
    `lengths` (unconstrained_matched): the output lengths its requests take in turn;
    `mask_split`: the vocabulary parts of this process's mask fill (json_schema_split)."""
    import os

    os.environ["KVPILOT_MASK_SPLIT"] = str(mask_split)
    if fill_threads is not None:
        from kvpilot.engine.structured import matchers

        matchers.fill_threads = lambda: fill_threads
    from kvpilot.engine.contracts.args import EngineArgs
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine

    device = "cpu" if smoke else "cuda"
    batch, warm_steps, timed_steps = (4, 3, 150) if smoke else (64, 30, 300)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", device=device, max_model_len=1024,
        dtype="float32" if smoke else "bfloat16", max_num_seqs=batch,
        async_scheduling="off" if mode == "unconstrained_sync" else "auto",
        structured_outputs_backend="guidance" if mode in (GUIDANCE_MODE, SPLIT_MODE)
        else "auto",
        kv_cache_memory="64MiB" if smoke else None, gpu_memory_utilization=0.85))
    vocab = engine.model_config.vocab_size
    rng = random.Random(1)
    structured = (StructuredOutputsParams(json=json.dumps(SCHEMA))
                  if mode in ("json_schema", GUIDANCE_MODE, SPLIT_MODE) else None)
    # the constrained requests end when their JSON does; the others at 256 tokens (ignore_eos)
    params = SamplingParams(temperature=1.0, max_tokens=256, structured_outputs=structured,
                            ignore_eos=structured is None)
    ids = iter(range(10**9))

    def add_request() -> None:
        i = next(ids)
        p = params if not lengths else \
            SamplingParams(temperature=1.0, max_tokens=lengths[i % len(lengths)], ignore_eos=True)
        engine.add_request(f"r{i}", [rng.randrange(vocab - 3) for _ in range(32)], p)

    grammar_ms: list[float] = []
    wait_ms: list[float] = []
    phase_ms: dict[str, list[float]] = {}  # every host phase of the decode steps
    other_phase_ms: dict[str, list[float]] = {}  # and of the other (mixed, eager) steps
    in_flight = 0

    def after_timed_step(decode: bool) -> None:
        nonlocal in_flight
        in_flight += engine.flights.inflight is not None
        if decode:
            grammar_ms.append(engine._phases.get("grammar", 0.0) * 1e3)
            wait_ms.append(engine._phases.get("mask_wait", 0.0) * 1e3)
        for name, seconds in engine._phases.items():
            (phase_ms if decode else other_phase_ms).setdefault(name, []).append(seconds * 1e3)

    loop = closed_loop(engine, batch, warm_steps, timed_steps, add_request, after_timed_step)
    step_ms = loop.decode_step_ms
    stats = engine.get_stats()
    split_rows = engine._grammars.split_rows if engine._grammars is not None else 0
    engine.shutdown()
    return {"mode": mode, "device": device, "batch": batch, "timed_steps": timed_steps,
            "decode_step_ms_median": statistics.median(step_ms) if step_ms else None,
            "pure_decode_steps": len(step_ms), "output_tok_per_s": loop.tok_per_s,
            "grammar_fill_ms_median": statistics.median(grammar_ms) if grammar_ms else None,
            "mask_wait_ms_median": statistics.median(wait_ms) if wait_ms else None,
            "steps_left_in_flight": in_flight,
            "phases_ms_median": {name: round(statistics.median(v), 3)
                                 for name, v in phase_ms.items()},
            # where the steps that are not whole-batch decodes spend their time
            "other_steps": len(loop.other_step_ms),
            "other_step_ms_mean": statistics.mean(loop.other_step_ms) if loop.other_step_ms
            else None,
            "decode_step_ms_mean": statistics.mean(step_ms) if step_ms else None,
            # the eager steps alone ("other" also holds graph steps of a part-full batch)
            "eager_step_ms_mean": statistics.mean(loop.eager_step_ms) if loop.eager_step_ms
            else None,
            "other_phases_ms_mean": {name: round(statistics.mean(v), 3)
                                     for name, v in other_phase_ms.items()},
            "graph_steps": stats.graph_steps, "eager_steps": stats.eager_steps,
            "mask_split": mask_split, "rows_filled_by_parts": split_rows,
            "output_lengths": loop.finished_lengths}


def validate_outputs(model: str, smoke: bool) -> int:
    """Gives how many of 8 constrained outputs parse and validate (they all must)."""
    import jsonschema

    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
    from kvpilot.engine.entrypoints.llm import LLM

    # room for long numbers: random weights may write hundreds of digits where the schema
    # bounds none, and a reply cut at max_tokens cannot parse
    llm = LLM(model, load_format="dummy", device="cpu" if smoke else "cuda",
              max_model_len=1024 if smoke else 4096,
              dtype="float32" if smoke else "bfloat16", gpu_memory_utilization=0.85,
              kv_cache_memory="64MiB" if smoke else None)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=900 if smoke else 4000,
                             structured_outputs=
                             StructuredOutputsParams(json=json.dumps(SCHEMA))) for s in range(8)]
    good = 0
    for out in llm.generate([[5, 6, 7]] * len(params), params):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            good += 1
        except (ValueError, jsonschema.ValidationError):
            print(f"invalid output: {out.outputs[0].text[:200]!r}", file=sys.stderr)
    return good


def mask_fill(model: str, smoke: bool) -> dict:
    """Gives the mask fill's cost alone at the bench's batch (structured_mask_fill.py)."""
    from structured_mask_fill import mask_fill_costs

    from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS, is_builtin
    from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
    from kvpilot.engine.contracts.tokenizer import load_tokenizer
    from kvpilot.engine.structured.grammar import grammar_of

    config = BUILTIN_CONFIGS[model] if is_builtin(model) else json.loads(
        (Path(model) / "config.json").read_text())
    eos = config["eos_token_id"]
    return mask_fill_costs(load_tokenizer(model).to_json(), config["vocab_size"],
                           eos if isinstance(eos, list) else [eos],
                           grammar_of(StructuredOutputsParams(json=json.dumps(SCHEMA))),
                           batch=4 if smoke else 64, steps=6 if smoke else 90)


def print_row(row: dict) -> None:
    """Prints a mode's numbers as one JSON line, without its list of output lengths."""
    print(json.dumps({k: v for k, v in row.items() if k != "output_lengths"}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="Issue 24: structured outputs at batch 64")
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny-qwen3, a few steps")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--fill-threads", default="",
                        help="comma-separated mask-fill thread counts: one more json_schema "
                             "row each (the engine's default is the CPUs but one)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs the modes this many rounds in turn (engines' eager steps vary "
                             "from process to process): the matched ratio of each round and "
                             "their median")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="0.6b",
                        help="the model's shape (CUDA; the smoke runs tiny-qwen3)")
    parser.add_argument("--mask-split", type=int, default=4,
                        help=f"vocabulary parts of the {SPLIT_MODE} mode's mask fill")
    parser.add_argument("--no-checks", action="store_true",
                        help="skips the 8 validated outputs and the mask fill alone (a call "
                             "with a time budget)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        one_thread_per_process()
    scratch = Path(tempfile.mkdtemp(prefix="kvpilot-structured-bench-"))  # MBs: not in out
    atexit.register(shutil.rmtree, scratch, True)
    model = "tiny-qwen3" if args.smoke else str(model_dir(scratch, args.shape))
    rows = []
    for round_ in range(args.repeat):
        for mode in args.modes.split(","):  # each engine in its own process: KV cache freed
            lengths = None
            if mode == "unconstrained_matched":  # this round's constrained output lengths
                done = [r for r in rows if r["mode"] == "json_schema" and r["round"] == round_]
                if not done or not done[0]["output_lengths"]:
                    parser.error("unconstrained_matched runs after json_schema (--modes order)")
                lengths = done[0]["output_lengths"]
            row = call_in_fresh_process(run_mode, model, mode, args.smoke, None, lengths,
                                        args.mask_split if mode == SPLIT_MODE else 1,
                                        reuse_imports=args.smoke)
            rows.append({**row, "round": round_})
            print_row(rows[-1])
    for threads in [int(t) for t in args.fill_threads.split(",") if t]:
        row = call_in_fresh_process(run_mode, model, "json_schema", args.smoke, threads,
                                    reuse_imports=args.smoke)
        rows.append({**row, "mode": f"json_schema, {threads} fill threads", "round": 0})
        print_row(rows[-1])
    by_mode = {r["mode"]: r for r in reversed(rows)}  # each mode's first round
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "host": platform.node(), "shape": "tiny-qwen3" if args.smoke else args.shape,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "smoke": args.smoke, "rows": rows, "mask_split": args.mask_split,
              "valid_outputs_of_8": None if args.no_checks else call_in_fresh_process(
                  validate_outputs, model, args.smoke, reuse_imports=args.smoke),
              "mask_fill": None if args.no_checks else call_in_fresh_process(
                  mask_fill, model, args.smoke, reuse_imports=args.smoke)}
    base, constrained = by_mode.get("unconstrained"), by_mode.get("json_schema")
    if base and constrained and base["decode_step_ms_median"] and \
            constrained["decode_step_ms_median"]:
        result["slowdown_decode_step"] = (constrained["decode_step_ms_median"]
                                          / base["decode_step_ms_median"])
        result["slowdown_tok_per_s"] = base["output_tok_per_s"] / constrained["output_tok_per_s"]
    for constrained_mode, key in (("json_schema", "slowdown_tok_per_s_matched"),
                                  (GUIDANCE_MODE, "slowdown_guidance_tok_per_s_matched"),
                                  (SPLIT_MODE, "slowdown_split_tok_per_s_matched")):
        ratios = []  # each round's unconstrained_matched / constrained tok/s
        for i in range(args.repeat):
            one = {r["mode"]: r for r in rows if r["round"] == i}
            if "unconstrained_matched" in one and constrained_mode in one:
                ratios.append(one["unconstrained_matched"]["output_tok_per_s"]
                              / one[constrained_mode]["output_tok_per_s"])
        if ratios:
            result[key] = statistics.median(ratios)
            result[f"{key}_rounds"] = ratios
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    lines = ["| round | mode | decode step ms (median) | output tok/s | mask fill ms (median) | "
             "mask wait ms (median) | eager steps |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['mode']} | {r['decode_step_ms_median']} | "
              f"{r['output_tok_per_s']:.0f} | "
              f"{r['grammar_fill_ms_median']} | {r['mask_wait_ms_median']} | "
              f"{r['eager_steps']} |" for r in rows]
    lines.append(f"\nmask fill alone, ms per step: {json.dumps(result['mask_fill'])}")
    lines.append(f"\nslowdown (json_schema / unconstrained, decode step): "
                 f"{result.get('slowdown_decode_step')}; output tok/s, unconstrained_matched / "
                 f"json_schema: {result.get('slowdown_tok_per_s_matched')} (median of rounds "
                 f"{result.get('slowdown_tok_per_s_matched_rounds')}); llguidance: "
                 f"{result.get('slowdown_guidance_tok_per_s_matched')} (rounds "
                 f"{result.get('slowdown_guidance_tok_per_s_matched_rounds')}); llguidance with "
                 f"the vocabulary in "
                 f"{args.mask_split} parts: {result.get('slowdown_split_tok_per_s_matched')} "
                 f"(rounds {result.get('slowdown_split_tok_per_s_matched_rounds')}); valid "
                 f"outputs: {result['valid_outputs_of_8']}/8 (goal: <= 1.10, 8/8)")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["valid_outputs_of_8"] in (8, None) else 1


if __name__ == "__main__":
    sys.exit(main())
