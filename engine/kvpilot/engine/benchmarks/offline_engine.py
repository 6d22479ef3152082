"""The offline engine as the two offline benchmarks drive it: its flags (`kvpilot serve`'s
engine flags), the `LLM` they build, its progress bar, and the tokens its outputs hold.

Imports no torch: the engine is imported when a benchmark runs, so `--help` stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvpilot.engine.contracts.args import (
    EngineArgs,
    add_dataclass_args,
    from_namespace,
    model_from_cli,
)

if TYPE_CHECKING:
    from kvpilot.engine.contracts.outputs import RequestOutput
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

T = TypeVar("T")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags both offline benchmarks take: --n, --output-json, --disable-tqdm, and
    every engine flag of `kvpilot serve`."""
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--output-json", type=Path, default=None,
                        help="write the result to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true",
                        help="no progress bar (drawn only on an interactive terminal)")
    add_dataclass_args(parser.add_argument_group("engine flags (as kvpilot serve)"), EngineArgs)


def check_at_least(args: argparse.Namespace, minimum: int, *names: str) -> None:
    """Raises ValueError naming the flag when one of `names` is below `minimum`."""
    for name in names:
        value = getattr(args, name)
        if value < minimum:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{name}={value} is invalid: pass {flag} {minimum} or more")


def engine_args(args: argparse.Namespace, command: str) -> EngineArgs:
    """Gives the engine's flags; raises ValueError naming the fix when --model is missing."""
    args.model = model_from_cli(None, args.model, f"{command} --model")
    return from_namespace(EngineArgs, args)


def open_llm(engine: EngineArgs) -> LLM:
    """Gives the offline engine built from `engine` (loads torch and the model)."""
    from kvpilot.engine.entrypoints.llm import LLM

    return LLM(**asdict(engine))


def shows_progress(args: argparse.Namespace) -> bool:
    """Gives whether to draw progress bars: on an interactive terminal, unless disabled."""
    return not args.disable_tqdm and sys.stderr.isatty()


def progress(items: Iterable[T], total: int, desc: str, enabled: bool) -> Iterable[T]:
    """Gives `items`, through a tqdm bar on stderr when `enabled`."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)


def generate(llm: LLM, prompts: Sequence[str | list[int]],
             params: SamplingParams | list[SamplingParams], use_tqdm: bool
             ) -> list[RequestOutput]:
    """Gives `llm.generate`'s outputs, with its per-prompt progress bar when `use_tqdm`."""
    return llm.generate(list(prompts), params, use_tqdm=use_tqdm)


def token_counts(outputs: Sequence[RequestOutput]) -> tuple[int, int]:
    """Gives the prompt tokens the engine saw and the tokens it generated (every completion)."""
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return prompt, generated


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Writes `record`, dated, to `path` (its folder made if missing)."""
    dated = {"date": datetime.now(UTC).isoformat(timespec="seconds"), **record}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dated, indent=2) + "\n")
