"""`kvpilot generate`: run prompts through the engine in-process and print the completions."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs, add_dataclass_args

# Engine flags that mean nothing without a server: its name for clients, a disaggregated
# role and its KV transfer (fleet secret included), and LoRA (no prompt here names an adapter).
SERVING_ONLY = frozenset({"served_model_name", "role", "kv_transfer_port", "fleet_secret_file",
                          "insecure_kv", "kv_transport", "enable_lora", "lora_modules",
                          "max_loras", "max_lora_rank"})


class _ServeOnly(argparse.Action):
    """Refuses a flag of `kvpilot serve` by name, instead of running and ignoring it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is a flag of `kvpilot serve`: kvpilot generate runs the "
                     "prompts in this process, with no server, fleet role or adapters; drop "
                     f"{option_string}, or serve the model with `kvpilot serve`")


def _serving_flags() -> list[str]:
    """Gives the spellings of every server and serving-only engine flag (a bool's --no-x too)."""
    out = []
    for f in [*fields(ServerArgs), *(f for f in fields(EngineArgs) if f.name in SERVING_ONLY)]:
        name = f.name.replace("_", "-")
        out += [f"--{name}", f"--no-{name}"] if isinstance(f.default, bool) else [f"--{name}"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the prompt and sampling flags, then the engine flags that mean something offline;
    the server's flags are refused by name (and left out of --help)."""
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt to complete (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default here) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--beam-width", type=int, default=1, help=">1 runs beam search")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_dataclass_args(parser, EngineArgs, skip=SERVING_ONLY)
    for flag in _serving_flags():
        parser.add_argument(flag, nargs="?", action=_ServeOnly, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)  # no attribute: EngineArgs' default


def run(args: argparse.Namespace) -> int:
    """Generates for every --prompt and prints the results; gives the exit code."""
    from dataclasses import asdict

    from kvpilot.engine.contracts.args import from_namespace, model_from_cli
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    try:
        args.model = model_from_cli(None, args.model, "generate --model")
        engine_args = from_namespace(EngineArgs, args)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos, beam_width=args.beam_width,
                                seed=args.sampling_seed)
        llm = LLM(**asdict(engine_args))
        try:
            outputs = (llm.beam_search(args.prompt, params) if args.beam_width > 1
                       else llm.generate(args.prompt, params))
        finally:
            llm.shutdown()  # stops a tensor-parallel engine's workers, frees its memory
    except ValueError as exc:
        print(f"kvpilot generate: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs]}))
            continue
        for c in out.outputs:
            print(f"{out.prompt!r} -> {c.text!r} [{c.finish_reason}]")
    return 0
