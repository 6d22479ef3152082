"""Issue 44's serving benchmark: Poisson arrivals at fractions of the measured saturation.

For each model shape and each mixed-step mode (`full`: one graph a step, attention inside,
the GPU's default; `piecewise`: attention between graphs; `off`: eager,
KVPILOT_PIECEWISE_GRAPHS=0), in a fresh `kvpilot serve --api-server-count 2` with dummy
weights: the nano-vllm recipe's requests (random ids, input and output lengths uniform in
100..1024, ignore_eos) sent all at once (rate inf) give the saturation request rate; then
the same kind of requests (another seed) arrive as a Poisson process at each `--fractions`
of it. Reported per run: output tok/s, ITL and TPOT p50/p99 (and their ratios), TTFT, and the
engine's forwards by mode (decode graph, full or piecewise mixed graph, eager) from /metrics, with the step-time
histogram per mode (`kvpilot_engine_step_seconds`).

    python bench/poisson_gpu.py --out DIR [--shapes 0.6b,8b] [--modes full,piecewise,off]
        [--fractions 0.5,0.8] [--requests 400] [--max-num-batched-tokens 512]
    python bench/poisson_gpu.py --out DIR --smoke   # tiny CPU run of every phase
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx
from serve_vs_offline import TINY, as_samples, kvpilot_serve, load, machine, recipe

SAMPLE = re.compile(r'^(kvpilot_engine_step_seconds_bucket|kvpilot_model_steps_total)'
                    r'\{([^}]*)\} (\S+)$', re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def step_histograms(base: str) -> dict[str, dict[str, float]]:
    """Gives /metrics' cumulative step-time buckets per mode, {mode: {le: count}}, with each
    mode's forwards under "steps"."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in SAMPLE.findall(text):
        label = dict(LABEL.findall(labels))
        key = "steps" if name == "kvpilot_model_steps_total" else label["le"]
        out.setdefault(label["mode"], {})[key] = float(value)
    return out


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
          ) -> dict[str, dict[str, float]]:
    return {mode: {k: v - before.get(mode, {}).get(k, 0.0) for k, v in counts.items()}
            for mode, counts in after.items()}


def quantile_bound(buckets: dict[str, float], q: float) -> float | None:
    """Gives the smallest bucket bound (ms) under which a `q` share of the steps fell."""
    bounds = sorted((float(le), n) for le, n in buckets.items() if le not in ("steps", "+Inf"))
    total = buckets.get("+Inf", 0.0)
    if total <= 0:
        return None
    for bound, n in bounds:
        if n >= q * total:
            return bound * 1e3
    return math.inf


def row(summary: dict[str, Any], steps: dict[str, dict[str, float]]) -> dict[str, Any]:
    itl50, itl99 = summary["median_itl_ms"], summary["p99_itl_ms"]
    tpot50, tpot99 = summary["median_tpot_ms"], summary["p99_tpot_ms"]
    return {"output_tok_s": summary["output_throughput"],
            "request_rate_reached": summary["request_throughput"],
            "itl_p50_ms": itl50, "itl_p99_ms": itl99, "itl_p99_over_p50": itl99 / max(itl50, 1e-9),
            "tpot_p50_ms": tpot50, "tpot_p99_ms": tpot99,
            "tpot_p99_over_p50": tpot99 / max(tpot50, 1e-9),
            "ttft_p50_ms": summary["median_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
            "steps": {mode: {"count": b.get("steps", b.get("+Inf", 0.0)),
                             "p50_ms_at_most": quantile_bound(b, 0.5),
                             "p99_ms_at_most": quantile_bound(b, 0.99),
                             "buckets": b} for mode, b in steps.items()}}


def run_shape(shape: str, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Gives one server's rate-inf and Poisson rows for `shape` with mixed-step graphs `mode`."""
    if args.smoke:
        config, flags = TINY, {"device": "cpu", "max_model_len": 256, "max_num_seqs": 16,
                               "num_kv_blocks": 128}
        lengths, requests = (8, 24), 24
    else:
        from e2e_gpu import LLAMA3_8B, QWEN3_0_6B

        config = {"0.6b": QWEN3_0_6B, "8b": LLAMA3_8B}[shape]
        flags = {"max_model_len": 4096, "max_num_seqs": 256}
        lengths, requests = (100, 1024), args.requests
    from e2e_gpu import model_dir

    flags |= {"served_model_name": "served",
              "max_num_batched_tokens": args.max_num_batched_tokens}
    path = str(model_dir(tmp, shape, config))
    if mode not in ("full", "piecewise", "off"):
        raise SystemExit(f"--modes: {mode!r} is not full, piecewise or off")
    # on the CPU smoke run: the called pieces (the interpreter would take minutes for full)
    os.environ["KVPILOT_PIECEWISE_GRAPHS"] = {"off": "0", "piecewise": "piecewise",
                                              "full": ""}[mode] if not args.smoke else (
        "0" if mode == "off" else "1")
    vocab = config["vocab_size"]
    out: dict[str, Any] = {"shape": shape, "piecewise": mode, "flags": flags}
    with kvpilot_serve(path, flags, 2, tmp / f"serve-{shape}-{mode}.log") as (base, proc):
        burst = as_samples(*recipe(min(256, requests), *lengths, vocab, seed=0))
        # the first request after ready, alone, then the same kind again once warm
        first = load(base, burst[:1], math.inf, 1, proc)
        load(base, burst[1:17], math.inf, args.clients, proc)
        again = load(base, burst[17:18], math.inf, 1, proc)
        out["first_request"] = {"ttft_ms": first["mean_ttft_ms"],
                                "warm_ttft_ms": again["mean_ttft_ms"],
                                "ratio": first["mean_ttft_ms"] / max(again["mean_ttft_ms"], 1e-9),
                                "prompt_tokens": [first["total_input_tokens"],
                                                  again["total_input_tokens"]]}
        before = step_histograms(base)
        saturated = load(base, burst, math.inf, args.clients, proc)
        out["rate_inf"] = row(saturated, delta(step_histograms(base), before))
        saturation = saturated["request_throughput"]
        for i, fraction in enumerate(args.fractions):
            samples = as_samples(*recipe(requests, *lengths, vocab, seed=1 + i))
            before = step_histograms(base)
            summary = load(base, samples, fraction * saturation, args.clients, proc)
            out[f"poisson_{fraction}"] = {"request_rate": fraction * saturation,
                                          **row(summary, delta(step_histograms(base), before))}
    return out


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| shape | mixed graphs | load | tok/s | ITL p50 | ITL p99 | p99/p50 | "
             "TPOT p50 | TPOT p99 | p99/p50 | TTFT p99 | steps: graph / full / piecewise / eager "
             "(p99 ms at most) |", "|" + "---|" * 12]
    for r in results:
        for key, label in [("rate_inf", "rate inf"),
                           *[(k, f"Poisson {r[k]['request_rate']:.1f}/s ({k.split('_')[1]})")
                             for k in r if k.startswith("poisson_")]]:
            x = r[key]
            steps = " / ".join(
                f"{int(x['steps'].get(m, {}).get('count', 0))} "
                f"({x['steps'].get(m, {}).get('p99_ms_at_most')})"
                for m in ("graph", "full", "piecewise", "eager"))
            lines.append(
                f"| {r['shape']} | {r['piecewise']} | {label} | {x['output_tok_s']:.0f} | "
                f"{x['itl_p50_ms']:.2f} | {x['itl_p99_ms']:.2f} | {x['itl_p99_over_p50']:.2f} | "
                f"{x['tpot_p50_ms']:.2f} | {x['tpot_p99_ms']:.2f} | "
                f"{x['tpot_p99_over_p50']:.2f} | {x['ttft_p99_ms']:.0f} | {steps} |")
    lines += ["", "First request after ready (alone) against a later one (alone, warm): "
              + "; ".join(f"{r['shape']} mixed graphs {r['piecewise']}: TTFT "
                          f"{r['first_request']['ttft_ms']:.1f} ms vs "
                          f"{r['first_request']['warm_ttft_ms']:.1f} ms "
                          f"({r['first_request']['ratio']:.2f}x; prompts "
                          f"{r['first_request']['prompt_tokens']} tokens)" for r in results)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="0.6b,8b")
    parser.add_argument("--modes", default="full,off",
                        help="mixed-step graphs: full, piecewise and/or off")
    parser.add_argument("--fractions", default="0.5,0.8",
                        type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            for mode in args.modes.split(","):
                results.append(run_shape(shape, mode, args, Path(tmp)))
                (args.out / "poisson.json").write_text(json.dumps(results, indent=1))
                print(markdown(results[-1:], ""), flush=True)
    header = (f"# Poisson serving, {machine()}, {datetime.date.today()}\n\n"
              f"`python3 bench/poisson_gpu.py --shapes {args.shapes} --modes {args.modes} "
              f"--fractions {','.join(map(str, args.fractions))} --requests {args.requests} "
              f"--max-num-batched-tokens {args.max_num_batched_tokens}` "
              "(kvpilot serve --api-server-count 2, dummy weights, lengths 100..1024)")
    (args.out / "poisson.md").write_text(markdown(results, header))
    print(markdown(results, header))


if __name__ == "__main__":
    main()
