"""Disaggregated vs aggregated serving on two GPUs, same run, same workload.

A: one prefill engine (GPU 0) + one decode engine (GPU 1) behind `kvpilot route`.
B: two aggregated engines (GPU 0, GPU 1) behind `kvpilot route --policy least-load`.
Workload: steady decodes (short prompts, long outputs) mixed with long prompts
(4-8k tokens, short outputs) that, when aggregated, stall the decodes sharing a
batch with them. Reports ITL p99 of the steady decodes and total throughput.
Goal (issue 6): ITL p99 >= 2x lower with A at <= 10% throughput cost.

The model is a Llama-3.2-1B-shaped (`--shape 1b`) or Llama-3-8B-shaped (`--shape 8b`)
config with dummy weights (no downloads) and the bundled tiny tokenizer, so token counts
are exact and nothing leaves the machine. Every engine of both configs runs with the same
`--max-num-batched-tokens` (default 2048, vLLM's online default), except that
`--prefill-max-num-batched-tokens` gives the prefill engine, which runs no decodes, its own.

    PYTHONPATH=<dir with a kvpilot package> python bench/disagg_gpu.py [--seconds 60] \
        [--shape 8b] [--long-rate 2] [--decode-rate 4] [--max-num-batched-tokens 2048]

The defaults are the workload issue 6's result is stated for (8B shape, 2 long prompts/s,
4 decodes/s); bench/disagg_gpu_run.sh runs it and the neighbouring rates on a 2-GPU host.

Results: bench/results/disagg_gpu-<shape>.{json,md} (`--out` to change the folder), naming
the GPUs and the flags. `--device cpu --shape tiny` is a smoke test of the script itself
(two CPU engine processes per config, short long prompts and decodes), not a
measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

from cpu_smoke import one_thread_per_process  # bench/ is this script's sys.path[0]
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.contracts.builtin_models import (
    TINY_VOCAB_SIZE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from kvpilot.engine.contracts.metric_names import (
    KV_PULLS,
    MODEL_STEPS,
    ROUTER_REQUESTS,
    ROUTER_TRANSFERRED_BLOCKS,
)
from kvpilot.engine.contracts.metrics_text import read_metrics
from kvpilot.engine.loadgen.datasets import SampleRequest, random_word_dataset
from kvpilot.engine.loadgen.report import percentile, summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark
from kvpilot.operator.local.plan import LocalProcess
from kvpilot.operator.local.supervisor import Supervisor, free_port

RESULTS = Path(__file__).parent / "results"
KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": TINY_VOCAB_SIZE, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 1,
            "eos_token_id": [0, 3]}
SHAPES = {
    "1b": LLAMA_1B,
    "8b": {**LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "tie_word_embeddings": False},
    # smoke test of the script on CPU only
    "tiny": {**LLAMA_1B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}


def write_model(root: Path, shape: str) -> Path:
    """Gives a model dir: the shape's config plus the bundled tokenizer files."""
    path = root / f"llama-{shape}-shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SHAPES[shape]))
    shutil.copy(TOKENIZER_FILE, path / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG_FILE, path / "tokenizer_config.json")
    return path


def engine(name: str, role: str, gpu: int, model: Path, args: argparse.Namespace
           ) -> LocalProcess:
    port = free_port()
    cuda = args.device == "cuda"
    return LocalProcess(name, role, [
        *KVPILOT, "serve", "--model", str(model), "--served-model-name", "bench",
        "--load-format", "dummy", "--dtype", "bfloat16" if cuda else "float32",
        "--device", args.device, "--max-model-len", "12288",
        "--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens
                                        if role == "prefill" else args.max_num_batched_tokens),
        "--role", role,
        # one host, no other tenant: the KV ports run without a fleet secret
        *(["--kv-transport", args.kv_transport, "--insecure-kv"] if role != "both" else []),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        {"CUDA_VISIBLE_DEVICES": str(gpu)} if cuda else {}, port)


def router(engines: list[LocalProcess], policy: str, min_prompt_tokens: int = 0
           ) -> LocalProcess:
    port = free_port()
    return LocalProcess("router", "router", [
        *KVPILOT, "route", "--policy", policy,
        *(["--disagg-min-prompt-tokens", str(min_prompt_tokens)] if min_prompt_tokens else []),
        "--instances",
        ",".join(f"{e.role}={e.url}" for e in engines), "--refresh-interval", "0.5",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], {}, port)


def workloads(args: argparse.Namespace) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """Gives (long prompts, steady decodes) sized to last about `args.seconds`."""
    n_long = max(1, int(args.long_rate * args.seconds))
    n_decode = max(1, int(args.decode_rate * args.seconds))
    # ~2 tokens per word with the tiny tokenizer: 2-4k words is 4-8k tokens
    long = random_word_dataset(n_long, args.long_words, 16, 1 / 3, args.seed)
    decode = random_word_dataset(n_decode, 64, args.decode_tokens, 0.0, args.seed + 1)
    return long, decode


async def drive(url: str, args: argparse.Namespace) -> dict:
    long, decode = workloads(args)
    long_cfg = BenchConfig(url, "bench", request_rate=args.long_rate, ignore_eos=True,
                           seed=args.seed)
    decode_cfg = BenchConfig(url, "bench", request_rate=args.decode_rate, ignore_eos=True,
                             seed=args.seed + 1)
    (long_res, long_t), (dec_res, dec_t) = await asyncio.gather(
        run_benchmark(long_cfg, long), run_benchmark(decode_cfg, decode))
    duration = max(long_t, dec_t)
    return {"decodes": summarize(dec_res, dec_t), "long_prompts": summarize(long_res, long_t),
            "all": summarize(long_res + dec_res, duration), "decode_gaps": gaps(dec_res)}


def gaps(results: list) -> dict[str, float]:
    """Gives the decodes' gaps apart (ms): the first (token 1 -> 2: disaggregated, that is
    the handoff: lease, pull, import) and the later ones (steps only). Both count in the
    ITL above; this says which of them sets its tail."""
    first = [r.itl[0] * 1000 for r in results if r.success and r.itl]
    later = [x * 1000 for r in results if r.success for x in r.itl[1:]]
    return {"first_p50_ms": percentile(first, 50), "first_p99_ms": percentile(first, 99),
            "first_max_ms": max(first, default=0.0), "later_p99_ms": percentile(later, 99),
            "later_max_ms": max(later, default=0.0)}


def run_config(name: str, processes: list[LocalProcess], log_dir: Path,
               args: argparse.Namespace) -> dict:
    supervisor = Supervisor(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for process in processes:
            supervisor.start(process)
        supervisor.wait_ready(600, {"router": "/ready"})
        warm = random_word_dataset(4, 100, 8, 0.0, 99)  # compile/warm-up both engines
        asyncio.run(run_benchmark(BenchConfig(processes[-1].url, "bench"), warm))
        before = router_outcomes(processes[-1].url)
        steps_before = {p.name: model_steps(p.url) for p in processes[:-1]}
        result = asyncio.run(drive(processes[-1].url, args))
        after = router_outcomes(processes[-1].url)
        # e.g. transfer_fallback: a pull failed and the decode engine prefilled itself
        result["router_outcomes"] = {k: v - before.get(k, 0) for k, v in after.items()
                                     if v - before.get(k, 0)}
        # eager steps stretch the ITL of every decode in them: how many each engine ran
        result["engine_steps"] = {
            p.name: {mode: count - steps_before[p.name][mode]
                     for mode, count in model_steps(p.url).items()} for p in processes[:-1]}
        # which transport moved the KV of the decode engine's pulls (--kv-transport)
        result["kv_pulls"] = {p.name: kv_pulls(p.url) for p in processes[:-1]
                              if p.role == "decode"}
        return result
    finally:
        supervisor.stop()


def model_steps(url: str) -> dict[str, float]:
    """Gives an engine's forwards so far by mode (`graph` replays, `eager`)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {mode: read_metrics(text, [MODEL_STEPS], labels={"mode": mode})[0].get(MODEL_STEPS, 0.0)
            for mode in ("graph", "eager")}


def kv_pulls(url: str) -> dict[str, int]:
    """Gives a decode engine's completed KV pulls by the transport that moved their blocks."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {sample.labels["transport"]: int(sample.value)
            for family in text_string_to_metric_families(text) if family.name == KV_PULLS
            for sample in family.samples if sample.name.endswith("_total")}


def router_outcomes(url: str) -> dict[str, int]:
    """Gives the router's request counts by outcome, summed over instances, and the KV
    blocks decode instances imported (`transferred_blocks`)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == ROUTER_REQUESTS and sample.name.endswith("_total"):
                key = sample.labels["outcome"]
            elif family.name == ROUTER_TRANSFERRED_BLOCKS and sample.name.endswith("_total"):
                key = "transferred_blocks"
            else:
                continue
            out[key] = out.get(key, 0) + int(sample.value)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="model shape: 1b (Llama-3.2-1B), 8b (Llama-3-8B); tiny is for "
                             "the CPU smoke test")
    parser.add_argument("--long-rate", type=float, default=2.0, help="long prompts per second")
    parser.add_argument("--decode-rate", type=float, default=4.0, help="decodes per second")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="every engine of both configs (vLLM's online default)")
    parser.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                        help="the disaggregated prefill engine's (default: the same); it "
                             "runs no decodes whose ITL a long step would stall")
    parser.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                        help="the disaggregated router's: shorter prompts are prefilled by "
                             "the decode engine (kvpilot route's flag)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run both setups this many times, alternating; the ratios "
                             "reported are the medians, each run's are listed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-transport", choices=["tcp", "nixl"], default="tcp",
                        help="how the disaggregated setup's decode engine pulls KV (nixl needs "
                             "the nixl wheel; the report's kv_pulls say which transport ran)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep the processes' logs here (default: a temporary folder)")
    # smoke test of the script: --device cpu --shape tiny (shorter long prompts and decodes)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help=argparse.SUPPRESS)
    parser.add_argument("--long-words", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} is invalid: runs of both setups, at least 1")
    if args.prefill_max_num_batched_tokens is None:
        args.prefill_max_num_batched_tokens = args.max_num_batched_tokens
    if args.long_words is None:
        args.long_words = 3000 if args.device == "cuda" else 200
    if args.decode_tokens is None:
        args.decode_tokens = 256 if args.device == "cuda" else 32
    return args


def device_names(args: argparse.Namespace) -> str:
    """Gives the engines' devices in words, e.g. `2x NVIDIA H100 80GB HBM3`."""
    if args.device == "cpu":
        return "CPU (smoke test, not a measurement)"
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA GPUs, torch sees {torch.cuda.device_count()}")
    names = [torch.cuda.get_device_name(i) for i in (0, 1)]
    return f"2x {names[0]}" if names[0] == names[1] else " + ".join(names)


def flags(args: argparse.Namespace) -> str:
    """Gives the command line that reproduces the run."""
    out = (f"--shape {args.shape} --seconds {args.seconds:g} --long-rate {args.long_rate:g} "
           f"--decode-rate {args.decode_rate:g} "
           f"--max-num-batched-tokens {args.max_num_batched_tokens} --seed {args.seed}")
    if args.kv_transport != "tcp":
        out += f" --kv-transport {args.kv_transport}"
    if args.disagg_min_prompt_tokens:
        out += f" --disagg-min-prompt-tokens {args.disagg_min_prompt_tokens}"
    if args.prefill_max_num_batched_tokens != args.max_num_batched_tokens:
        out += f" --prefill-max-num-batched-tokens {args.prefill_max_num_batched_tokens}"
    if args.repeat > 1:
        out += f" --repeat {args.repeat}"
    if args.device != "cuda":
        out += (f" --device {args.device} --long-words {args.long_words} "
                f"--decode-tokens {args.decode_tokens}")
    return out


def failed(config: dict) -> int:
    return config["decodes"]["failed"] + config["long_prompts"]["failed"]


def report_failed(name: str, config: dict) -> None:
    print(f"{name}: {failed(config)} requests failed; router outcomes "
          f"{config['router_outcomes']}; engine forwards {config['engine_steps']}", flush=True)


def ratios(configs: dict) -> dict[str, float]:
    d, a = configs["disaggregated"], configs["aggregated"]
    return {"itl_p99_agg_over_disagg": a["decodes"]["p99_itl_ms"] / max(
                d["decodes"]["p99_itl_ms"], 1e-9),
            "throughput_disagg_over_agg": d["all"]["output_throughput"] / max(
                a["all"]["output_throughput"], 1e-9),
            "long_ttft_disagg_over_agg": d["long_prompts"]["median_ttft_ms"] / max(
                a["long_prompts"]["median_ttft_ms"], 1e-9)}


def row(name: str, c: dict) -> str:
    g = c["decode_gaps"]
    return (f"| {name} | {c['decodes']['median_itl_ms']:.1f} | {c['decodes']['p99_itl_ms']:.1f} | "
            f"{g['first_p50_ms']:.0f} / {g['first_p99_ms']:.0f} / {g['first_max_ms']:.0f}, "
            f"{g['later_p99_ms']:.1f} | {c['long_prompts']['median_ttft_ms']:.0f} | "
            f"{c['all']['output_throughput']:.0f} | {failed(c)} |")


def main() -> None:
    args = parse_args()
    if args.device == "cpu":  # the smoke run: its engine processes inherit one thread
        one_thread_per_process()
    random.seed(args.seed)
    gpu = device_names(args)
    report: dict = {"date": datetime.date.today().isoformat(), "gpu": gpu,
                    "flags": flags(args), "args": {k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items()},
                    "model_shape": SHAPES[args.shape], "runs": []}
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        model = write_model(Path(tmp), args.shape)
        logs = args.logs or Path(tmp)
        # the two setups alternate, fresh processes each time: the run-to-run spread of the
        # p99 ratio is part of the result
        for index in range(args.repeat):
            suffix = f"-{index + 1}" if args.repeat > 1 else ""
            pd = [engine("prefill", "prefill", 0, model, args),
                  engine("decode", "decode", 1, model, args)]
            agg = [engine("agg-0", "both", 0, model, args),
                   engine("agg-1", "both", 1, model, args)]
            configs = {"disaggregated": run_config(
                "disaggregated", [*pd, router(pd, "prefix-aware", args.disagg_min_prompt_tokens)], logs / f"pd{suffix}", args)}
            report_failed("disaggregated", configs["disaggregated"])
            configs["aggregated"] = run_config(
                "aggregated", [*agg, router(agg, "least-load")], logs / f"agg{suffix}", args)
            report_failed("aggregated", configs["aggregated"])
            report["runs"].append({"configs": configs, "ratios": ratios(configs)})
            # written after every run, so a run cut short by a time limit keeps the ones done
            write_report(report, args)


def write_report(report: dict, args: argparse.Namespace) -> None:
    report["configs"] = report["runs"][-1]["configs"]
    runs = [run["ratios"] for run in report["runs"]]
    report["ratios"] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (f"disagg_gpu-{args.shape}"
                       + ("-nixl" if args.kv_transport == "nixl" else ""))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [f"# Disaggregated vs aggregated on {report['gpu']} ({report['date']})", "",
             f"`python bench/disagg_gpu.py {report['flags']}` (Llama-{args.shape}-shaped dummy "
             "model)", "",
             "| config | decode ITL p50 (ms) | decode ITL p99 (ms) | of it: first gap p50 / p99 / "
             "max, later gaps p99 (ms) | long-prompt TTFT p50 (ms) | output tok/s | failed |",
             "|---|---|---|---|---|---|---|"]
    for index, run in enumerate(report["runs"]):
        suffix = f", run {index + 1}" if len(report["runs"]) > 1 else ""
        lines += [row(name + suffix, c) for name, c in run["configs"].items()]
    r = report["ratios"]
    each = "; per run " + ", ".join(f"{x['itl_p99_agg_over_disagg']:.2f}x" for x in runs) if (
        len(runs) > 1) else ""
    lines += ["", f"ITL p99 aggregated / disaggregated: {r['itl_p99_agg_over_disagg']:.2f}x"
              f"{' (median)' if len(runs) > 1 else ''}{each}; throughput disaggregated / "
              f"aggregated: {r['throughput_disagg_over_agg']:.2f}x (goal: >= 2x and >= 0.9x); "
              f"long-prompt TTFT p50 disaggregated / aggregated: "
              f"{r['long_ttft_disagg_over_agg']:.2f}x (issue 22's goal: <= 1.2x); decode "
              f"engine's pulls by transport: {report['configs']['disaggregated']['kv_pulls']}",
              ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.md", flush=True)


if __name__ == "__main__":
    main()
