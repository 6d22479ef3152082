"""A/B in one process: the Gluon prefill kernel before (calls/gluon_old.py, 3dede76) and after
(early query release + block 0 before the queries), against torch's SDPA, issue 21's shapes."""
import functools, json, sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
from triton.testing import do_bench
from torch.nn.attention import SDPBackend, sdpa_kernel
import importlib
MODS = {n: importlib.import_module('gluon_' + n) for n in os.environ.get('VARIANTS', 'old v4 v5 v6').split()}

def ms(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")

res = []
for (B, N, H, KV) in ((8, 4096, 32, 32), (8, 4096, 32, 8), (16, 2048, 32, 8)):
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
    for l2 in (10,):
        for name, mod in MODS.items():
            runs[f"{name} l2={l2}"] = functools.partial(mod.gluon_prefill_attention, q, k, v, starts, N, scale, l2_bytes=l2 << 20)
    for name, fn in runs.items():
        if not name.startswith("sdpa"):
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, (name, err)
    times = {name: [] for name in runs}
    for _ in range(3):
        for name, fn in runs.items():
            times[name].append(ms(fn))
    best_sdpa = min(min(times["sdpa default"]), min(times["sdpa cudnn"]))
    row = {"shape": f"B={B} N={N} {H}q/{KV}kv"}
    for name, t in times.items():
        row[name] = {"ms": [round(x, 4) for x in t], "tflops": round(flops / min(t) / 1e9, 1),
                     "of_sdpa": round(best_sdpa / min(t), 3)}
    print(json.dumps(row), flush=True)
    res.append(row)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gluon_ab.json"), "w"), indent=1)
