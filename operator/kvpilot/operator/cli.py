"""The `kvpilot operator` subcommand: run the kopf operator (kopf is imported only in `run`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvpilot.operator.render.meta import RenderConfig


def namespace_name(text: str) -> str:
    """Gives `text` if it names one namespace; refuses glob patterns (argparse type)."""
    if any(c in text for c in "*?[]!,"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a pattern: name each namespace (the operator's Roles are granted "
            "per named namespace, and it does not list namespaces to match patterns)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the operator's flags."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       type=namespace_name, help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default when no --namespace is given)")
    parser.add_argument("--liveness", type=int, default=None, metavar="PORT",
                        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="coordinate with other operator replicas through this "
                             "KopfPeering object (default: standalone)")
    parser.add_argument("--standalone", action="store_true",
                        help="ignore peering even when --peering is set")
    parser.add_argument("--dev", action="store_true",
                        help="short watch timeouts and quick shutdown, for local clusters and tests")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    defaults = RenderConfig()
    parser.add_argument("--engine-image", default=defaults.engine_image,
                        help="engine image when a spec's overrides.image is unset")
    parser.add_argument("--router-image", default=defaults.router_image,
                        help="image of the router pods")
    parser.add_argument("--leader-worker-set", action="store_true",
                        help="render multi-node replicas as LeaderWorkerSets (LWS CRD installed)")
    parser.add_argument("--inference-pool", action="store_true",
                        help="render an InferencePool (Gateway API inference extension, its CRD "
                             "installed) for each InferenceModel with spec.inferencePool")
    parser.add_argument("--drain-timeout", type=int, default=defaults.drain_timeout_seconds,
                        metavar="SECONDS", help="seconds engines get to drain after SIGTERM")
    parser.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE"),
                        metavar="NS", help="namespace of the operator's pods, which the models' "
                                           "NetworkPolicies let in (default: $POD_NAMESPACE; "
                                           "unset: the models' own namespace)")
    parser.add_argument("--operator-pod-labels", default=",".join(
        f"{k}={v}" for k, v in defaults.operator_pod_labels), metavar="K=V,...",
                        help="labels of the operator's pods, which the NetworkPolicies let in")
    parser.add_argument("--metrics-namespace", action="append", default=[], metavar="NS",
                        help="also let pods of this namespace (e.g. a Prometheus) reach engines' "
                             "and routers' /metrics (repeatable)")
    parser.add_argument("--compile-cache-dir", default=defaults.compile_cache_dir, metavar="DIR",
                        help="a node directory writable by uid 1000 that engine pods mount as "
                             "their Triton cache (hostPath), so engines on a node that served "
                             "before start with compiled kernels; empty (default): each pod's "
                             "own emptyDir")
    parser.add_argument("--max-pool-gpus", type=int, default=defaults.max_pool_gpus,
                        metavar="GPUS", help="refuse a pool whose replicas need more GPUs "
                                             "(bounds what one object makes the operator render)")


def render_config(args: argparse.Namespace) -> RenderConfig:
    """Gives the render settings the flags ask for."""
    return RenderConfig(engine_image=args.engine_image, router_image=args.router_image,
                        leader_worker_set=args.leader_worker_set,
                        drain_timeout_seconds=args.drain_timeout,
                        inference_pool=args.inference_pool,
                        max_pool_gpus=args.max_pool_gpus,
                        compile_cache_dir=args.compile_cache_dir,
                        operator_namespace=args.operator_namespace,
                        operator_pod_labels=_labels(args.operator_pod_labels),
                        metrics_namespaces=tuple(args.metrics_namespace))


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--operator-pod-labels={text!r}: write KEY=VALUE[,KEY=VALUE...]")
    return tuple((k, v) for k, v in pairs)


def run(args: argparse.Namespace) -> int:
    """Runs the operator until SIGINT/SIGTERM; gives the exit code (1, and one line on
    stderr, when there are no credentials or the API server cannot be reached)."""
    import asyncio

    import kopf

    from kvpilot.operator.handlers import register
    from kvpilot.operator.handlers.lifecycle import operator_settings
    from kvpilot.operator.kube.login import KubeconfigError, LoginError, check_reachable, login

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = operator_settings(fast=args.dev)
    try:
        asyncio.run(check_reachable(login(settings)))
    except LoginError as exc:
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, KubeconfigError) else 1
    register()
    namespaces = list(args.namespace)
    asyncio.run(kopf.operator(
        settings=settings,
        memo=kopf.Memo(render=render_config(args)),
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone or args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness}/healthz" if args.liveness else None,
    ))
    return 0
