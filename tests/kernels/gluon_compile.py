"""Compiles the Gluon prefill kernel for an H100 (sm_90a) without a GPU, specialised as a launch
on the engine's tensors would be; prints one JSON line per case: shared memory, the PTX's
global-store widths, whether whole tiles leave by TMA, and the cubin's registers, stack and
local memory (spills).

Run as a script, without TRITON_INTERPRET (the interpreter cannot compile Gluon):
`python tests/kernels/gluon_compile.py`. tests/kernels/test_prefill_attention_gluon.py runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from kvpilot.kernels import prefill_attention_gluon as kernel

# (head_dim, GQA group, dtype, cached prefixes): the cases the GPU tests run, compiled here on
# any machine
CASES = ((128, 1, "bf16", False), (128, 4, "fp16", False), (64, 8, "bf16", False),
         (128, 4, "bf16", True))


def descriptor(shape: list[int], dtype: str) -> str:
    """Triton's signature string of a Gluon TMA descriptor over `shape` tiles."""
    element = gl.bfloat16 if dtype == "bf16" else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(shape, element)
    return f"tensordesc<{dtype}[{', '.join(map(str, shape))}],{layout!r}>"


def launch_attrs() -> dict:
    """The divisibility a launch gives the output's pointer and strides (the engine's output is
    16-byte aligned and its strides are the model's heads x head_dim, multiples of 16), less
    what the kernel asks not to specialise: what decides its stores' width."""
    fn = kernel._prefill_kernel
    names = [param.name for param in fn.params]
    kept = [param.name for param in fn.params if not param.do_not_specialize]
    return {(names.index(name),): [["tt.divisibility", 16]]
            for name in ("out_ptr", "stride_ot", "stride_oh") if name in kept}


def compile_case(head_dim: int, group: int, dtype: str, prefix: bool) -> dict:
    signature = {
        "q_desc": descriptor([kernel.HALF, head_dim], dtype),
        "k_desc": descriptor([kernel.BLOCK_N, head_dim], dtype),
        "v_desc": descriptor([kernel.BLOCK_N, head_dim], dtype),
        "qsl_ptr": "*i32", "kvs_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": f"*{dtype}",
        "o_desc": descriptor([kernel.HALF, head_dim], dtype),
        "stride_ot": "i32", "stride_oh": "i32",
        "qk_scale": "fp32", "num_heads": "i32", "num_seqs": "i32", "num_m": "i32", "group": "i32",
        "GROUP": "constexpr", "HEAD_DIM": "constexpr", "NUM_STAGES": "constexpr",
        "Q_BUFS": "constexpr", "TMA_STORE": "constexpr", "PREFIX": "constexpr"}
    constants = {"GROUP": group, "HEAD_DIM": head_dim, "NUM_STAGES": kernel.STAGES,
                 "Q_BUFS": kernel.Q_BUFFERS, "TMA_STORE": True, "PREFIX": prefix}
    compiled = triton.compile(
        GluonASTSource(kernel._prefill_kernel, signature, constants, launch_attrs()),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4, "maxnreg": kernel.MAX_REGS})
    ptx = compiled.asm["ptx"]
    result = {"head_dim": head_dim, "group": group, "dtype": dtype, "prefix": prefix,
              "shared": compiled.metadata.shared, "cubin": len(compiled.asm.get("cubin", b"")),
              "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": "setmaxnreg" in ptx,
              # the output's global stores, by width (b16: one element per instruction)
              "stores": sorted(set(re.findall(r"st\.global\.(?:v\d\.)?b\d+", ptx))),
              "tma_store": "cp.async.bulk.tensor.2d.global.shared" in ptx}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout
        for name in ("REG", "STACK", "LOCAL"):
            found = re.search(rf"\b{name}:(\d+)", usage)
            assert found, usage
            result[name.lower()] = int(found.group(1))
    return result


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET"
    for case in CASES:
        print(json.dumps(compile_case(*case)), flush=True)
    sys.exit(0)
