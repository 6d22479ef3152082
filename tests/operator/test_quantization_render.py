"""spec.engine.quantization / kvCacheDtype: rendered into `kvpilot serve` flags that parse,
refused on accelerators that cannot run them (naming the field), and counted by the
operator's memory planning (8-bit weights, 1-byte KV elements)."""

from __future__ import annotations

import argparse
from typing import Any, get_args

import pytest

from kvpilot.engine.contracts.args import KV_CACHE_DTYPES, QUANTIZATIONS, EngineArgs, from_namespace
from kvpilot.engine.server import cli as serve_cli
from kvpilot.operator.api.common import EngineSpec, KvCacheDtype, Quantization
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.kv_cache import check_kv_cache
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.planning.quantization import weight_bytes
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1}}


def serve_flags(engine: dict[str, Any], vendor: str = "cpu") -> EngineArgs:
    """Gives the EngineArgs the decode pool's pod command line parses into."""
    spec = InferenceModelSpec.model_validate({
        "model": {"name": "chat", "source": "dummy:tiny-llama"},
        "accelerator": {"vendor": vendor}, "engine": engine})
    pool = next(o for o in render_children(IM, spec, owned_pools(spec, "chat"), RenderConfig())
                if o["kind"] == "DecodePool")
    pool = {**pool, "metadata": {**pool["metadata"], "uid": "u2"}}
    resolved = resolve_pool(DecodePoolSpec.model_validate(pool["spec"]), spec)
    deployment = render_pool(pool, resolved, RenderConfig())[0]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return from_namespace(EngineArgs, parser.parse_args(args))


def test_api_choices_are_the_engine_flags_choices():
    assert get_args(Quantization) == QUANTIZATIONS
    assert get_args(KvCacheDtype) == KV_CACHE_DTYPES


@pytest.mark.parametrize(("engine", "vendor", "expected"), [
    ({}, "cpu", ("none", "auto")),
    ({"quantization": "int8"}, "cpu", ("int8", "auto")),
    ({"kvCacheDtype": "fp8"}, "cpu", ("none", "fp8")),
    ({"quantization": "fp8", "kvCacheDtype": "fp8"}, "nvidia", ("fp8", "fp8")),
])
def test_rendered_flags_parse(engine, vendor, expected):
    args = serve_flags(engine, vendor)
    assert (args.quantization, args.kv_cache_dtype) == expected


@pytest.mark.parametrize(("engine", "vendor", "message"), [
    ({"quantization": "fp8"}, "cpu", "engine.quantization=fp8 with accelerator.vendor=cpu"),
    ({"quantization": "fp8"}, "amd", "engine.quantization=fp8 with accelerator.vendor=amd"),
    ({"kvCacheDtype": "fp8"}, "amd", "engine.kvCacheDtype=fp8 with accelerator.vendor=amd"),
])
def test_unsupported_accelerator_is_refused(engine, vendor, message):
    with pytest.raises(ValueError, match=message):
        serve_flags(engine, vendor)


def test_unknown_value_is_refused_by_the_schema():
    with pytest.raises(ValueError, match="quantization"):
        EngineSpec.model_validate({"quantization": "int4"})


def test_extra_args_cannot_set_the_owned_flags():
    with pytest.raises(ValueError, match=r"spec\.engine\.quantization"):
        serve_flags({"extraArgs": ["--quantization", "int8"]})


@pytest.mark.parametrize(("engine", "expected"), [
    ({}, 16_000_000_000),  # bf16: 2 bytes a parameter
    ({"quantization": "int8"}, 10_400_000_000),  # 1 byte, plus up to 30% kept in bf16
    ({"quantization": "fp8", "dtype": "float32"}, 15_200_000_000),  # 1 + 30% x 3 bytes
])
def test_weight_bytes_count_8bit_weights(engine, expected):
    assert weight_bytes(8_000_000_000, EngineSpec.model_validate(engine), "nvidia") == expected


def test_kv_planning_counts_one_byte_per_fp8_element():
    """tiny-llama fp32 on CPU: one 2048-token sequence needs 128 blocks of 16 KiB, or of
    4 KiB with an fp8 cache; 600 KiB holds the fp8 sequence only."""
    from kvpilot.operator.api.common import ModelSource

    model = ModelSource.model_validate({"name": "t", "source": "dummy:tiny-llama"})
    engine = {"kvCacheMemory": "600KiB", "maxModelLen": 2048}
    with pytest.raises(ValueError, match=r"engine\.kvCacheMemory=600KiB"):
        check_kv_cache(model, EngineSpec.model_validate(engine), "cpu")
    check_kv_cache(model, EngineSpec.model_validate({**engine, "kvCacheDtype": "fp8"}), "cpu")
