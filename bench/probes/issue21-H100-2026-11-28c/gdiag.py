"""Where the Gluon prefill kernel's per-tile time goes: the kernel at N=1024..8192 (32/8 GQA,
32k tokens each), as is and with (a) its output stores predicated off, (b) no causal mask
(wrong results, timing only), against torch's fastest SDPA backend at each shape."""
import functools, json, os, sys, types, importlib.util
import torch
from triton.testing import do_bench
from torch.nn.attention import SDPBackend, sdpa_kernel
import kvpilot.kernels.prefill_attention_gluon as base

SRC = open(os.path.join(os.path.dirname(__file__), "gluon_head.py")).read()

def variant(name, *subs):
    src = SRC
    for a, b in subs:
        assert a in src, (name, a[:60])
        src = src.replace(a, b)
    path = f"/tmp/gluon_{name}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"gluon_{name}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

import gluon_head
MODS = {"head": gluon_head, "base": base}
if os.environ.get("DIAG"):
    MODS["head_nostore"] = variant("nostore", ("mask=(o_rows < q_len)[:, None])", "mask=((o_rows < q_len) & (qk_scale < 0.0))[:, None])"))
for extra in os.environ.get("EXTRA", "").split():
    MODS[extra] = importlib.import_module(extra)

def ms(fn):
    return do_bench(fn, warmup=25, rep=150, return_mode="median")

res = []
for (B, N, H, KV) in ((32, 1024, 32, 8), (16, 2048, 32, 8), (8, 4096, 32, 8), (4, 8192, 32, 8), (8, 4096, 32, 32)):
    d = 128; total = B * N
    q = torch.randn(total, H, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(total, KV, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    starts = torch.arange(0, total + 1, N, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    flops = 4 * B * H * N * N * d / 2
    bh = lambda x: x.view(B, N, x.shape[1], d).transpose(1, 2)
    qq, kk, vv = bh(q), bh(k), bh(v)
    gqa = {"enable_gqa": True} if KV != H else {}
    def sdpa(backend=None):
        if backend is None:
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, **gqa)
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, **gqa)
    ref = sdpa().transpose(1, 2).reshape(total, H, d).float()
    runs = {"sdpa default": sdpa, "sdpa cudnn": functools.partial(sdpa, SDPBackend.CUDNN_ATTENTION)}
    for name, mod in MODS.items():
        runs[name] = functools.partial(mod.gluon_prefill_attention, q, k, v, starts, N, scale)
    for name in [n for n in MODS if "nostore" not in n]:
        err = ((runs[name]().float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (name, err)
    times = {name: [] for name in runs}
    for _ in range(3):
        for name, fn in runs.items():
            times[name].append(ms(fn))
    best_sdpa = min(min(times["sdpa default"]), min(times["sdpa cudnn"]))
    row = {"shape": f"B={B} N={N} {H}q/{KV}kv"}
    for name, t in times.items():
        row[name] = {"ms": round(min(t), 4), "tflops": round(flops / min(t) / 1e9, 1),
                     "of_sdpa": round(best_sdpa / min(t), 3)}
    print(json.dumps(row), flush=True)
    res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gdiag.json"), "w"), indent=1)
