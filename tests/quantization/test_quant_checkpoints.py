"""Pre-quantised checkpoints written by the tests (HF/vLLM fp8 and compressed-tensors
layouts) load, and match load-time quantisation of the same bf16/fp32 weights.

Per-channel checkpoints are quantised by the same rule the loader uses, so they match
BITWISE (weights, scales and logits). Per-tensor ones match within rounding: each
loaded weight times its scale equals the checkpoint's exactly, and the logits stay
within the accuracy bounds of test_quant_accuracy.py. Unsupported layouts are refused
naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.quantized_checkpoints import write_quantized
from safetensors.torch import load_file, save_file
from test_quant_accuracy import BOUNDS, prompt_logits

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import load_model
from kvpilot.engine.quantization.config import (
    check_device,
    resolve_kv_cache_dtype,
    resolve_quantization,
)

# (method, scale strategy, config.json layout)
CASES = [("fp8", "channel", "fp8"), ("fp8", "tensor", "fp8"),
         ("fp8", "channel", "compressed-tensors"), ("int8", "channel", "compressed-tensors"),
         ("int8", "tensor", "compressed-tensors")]


def config_of(path) -> ModelConfig:
    return ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))


def quantized_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith(("weight", "weight_scale"))}


@pytest.mark.parametrize(("method", "strategy", "fmt"), CASES)
def test_prequantised_checkpoint_matches_load_time(method, strategy, fmt, tiny_checkpoints,
                                                   tmp_path):
    src = tiny_checkpoints("llama-bias")
    dst = write_quantized(src, tmp_path / "q", method, strategy, fmt)
    loaded = load_model(config_of(dst), "auto", "cpu")  # detected from config.json
    at_load = load_model(config_of(src), "auto", "cpu", quantization=method)
    got, want = quantized_params(loaded), quantized_params(at_load)
    assert got.keys() == want.keys()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert got[qkv].dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8)
    if strategy == "channel":
        for name in want:
            assert torch.equal(got[name].float(), want[name].float()), name
        assert torch.equal(prompt_logits(loaded), prompt_logits(at_load))
        return
    on_disk = load_file(str(dst / "model.safetensors"))
    for part, rows in (("q_proj", slice(0, 64)), ("v_proj", slice(96, 128))):
        name = f"model.layers.0.self_attn.{part}.weight"
        want_rows = on_disk[name].float() * on_disk[f"{name}_scale"].float()
        got_rows = got[qkv][rows].float() * got[f"{qkv}_scale"][rows, None]
        assert torch.equal(got_rows, want_rows), part
    expected = prompt_logits(load_model(config_of(src), "auto", "cpu"))
    rel = (prompt_logits(loaded) - expected).abs().max() / expected.abs().max()
    assert rel <= BOUNDS[method][0]


CT = {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}


def ct(**changes) -> dict:
    """Gives the compressed-tensors fp8 config above with its one group's fields changed."""
    group = json.loads(json.dumps(CT["config_groups"]["g"]))
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            group[section][field] = value
        else:
            group[section] = value
    return {**CT, "config_groups": {"g": group}}


# (flag, quantization_config, architecture) -> the method, or the words the error says
RESOLVE = [
    ("none", None, "LlamaForCausalLM", None),
    ("int8", None, "LlamaForCausalLM", ("int8", False)),
    ("none", {"quant_method": "fp8"}, "LlamaForCausalLM", ("fp8", True)),
    ("fp8", CT, "LlamaForCausalLM", ("fp8", True)),
    ("none", ct(weights__type="int", input_activations=None), "LlamaForCausalLM",
     ("int8", True)),
    ("int8", {"quant_method": "fp8"}, "LlamaForCausalLM", "already quantised to fp8"),
    ("none", {"quant_method": "awq"}, "LlamaForCausalLM", "quant_method='awq'"),
    ("none", {"quant_method": "fp8", "activation_scheme": "static"}, "LlamaForCausalLM",
     "activation_scheme='static'"),
    ("none", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "LlamaForCausalLM",
     "weight_block_size"),
    ("none", {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
     "LlamaForCausalLM", "ignored_layers"),
    ("none", {**CT, "kv_cache_scheme": {"num_bits": 8}}, "LlamaForCausalLM", "kv_cache_scheme"),
    ("none", ct(weights__strategy="group"), "LlamaForCausalLM", "channel or tensor strategy"),
    ("none", ct(weights__num_bits=4), "LlamaForCausalLM", "8-bit"),
    ("none", ct(input_activations=None), "LlamaForCausalLM", "input_activations=None"),
    ("none", {"quant_method": "fp8"}, "MixtralForCausalLM", "MixtralForCausalLM"),
]


@pytest.mark.parametrize(("flag", "qc", "arch", "expected"), RESOLVE)
def test_resolve_quantization(flag, qc, arch, expected):
    hf = {} if qc is None else {"quantization_config": qc}
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected.replace("[", r"\[")):
            resolve_quantization(flag, hf, arch)
        return
    quant = resolve_quantization(flag, hf, arch)
    got = None if quant is None else (quant.method.name, quant.prequantized)
    assert got == expected


def test_block_wise_scale_refused(tiny_checkpoints, tmp_path):
    """A scale whose size is neither 1 nor the row count is refused, naming the tensor."""
    dst = write_quantized(tiny_checkpoints("llama"), tmp_path / "q", "fp8", "channel")
    file = dst / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = torch.ones(4, 4)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale.*1 or 64 values"):
        load_model(config_of(dst), "auto", "cpu")


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.k_scale",
                                   "model.layers.0.mlp.down_proj.input_scale"])
def test_unread_scales_refused_naming_them(extra, tiny_checkpoints, tmp_path):
    dst = write_quantized(tiny_checkpoints("llama"), tmp_path / "q", "fp8", "channel")
    file = dst / "model.safetensors"
    tensors = load_file(str(file))
    tensors[extra] = torch.tensor(1.0)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{extra}'.*scales are not read"):
        load_model(config_of(dst), "auto", "cpu")


def test_fp8_refused_on_rocm_naming_the_flag(monkeypatch):
    """ROCm's torch reports an MI300X as compute capability 9.4, past fp8's 8.9, but its fp8
    is E4M3FNUZ, not the OCP E4M3 the kernels and the cache use: fp8 weights and an fp8 KV
    cache are refused there, before any CUDA call, with the flag to change."""
    monkeypatch.setattr(torch.version, "hip", "6.4")
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' has not run on ROCm.*"
                                         r"--kv-cache-dtype auto"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) is torch.bfloat16
    fp8 = resolve_quantization("fp8", {}, "LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"quantization='fp8' has not run on ROCm.*"
                                         r"--quantization int8"):
        check_device(fp8, cuda)
    check_device(resolve_quantization("int8", {}, "LlamaForCausalLM"), cuda)  # not fp8: allowed
