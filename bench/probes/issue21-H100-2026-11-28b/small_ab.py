"""A/B in one process, CUDA graphs of 28 launches (a layer each): rms_norm (+residual), the q/k
norm + rotary + KV write at Qwen3-0.6B shapes, and the decode graph's input copy, before
(/tmp/base, commit 3dede76) and after."""
import importlib.util, json, os, sys
import torch

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod

old_rms = load("old_rmsnorm", "/tmp/base/kernels/kvpilot/kernels/rmsnorm.py")
old_qk = load("old_qk", "/tmp/base/kernels/kvpilot/kernels/qk_norm_rotary.py")
from kvpilot.kernels import rmsnorm as new_rms, qk_norm_rotary as new_qk
from kvpilot.kernels.graph_inputs import DecodeInputs, copy_decode_inputs, decode_inputs_ref

def graph_us(body, launches=28):
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(7):
        e0.record()
        for _ in range(50): g.replay()
        e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 50 / launches * 1e3)
    return sorted(ts)[3]

res = {}
dev = "cuda"; bf = torch.bfloat16
for T in (64, 128, 256):
    x = [torch.randn(T, 1024, dtype=bf, device=dev) for _ in range(28)]
    r = [torch.randn(T, 1024, dtype=bf, device=dev) for _ in range(28)]
    w = torch.randn(1024, dtype=bf, device=dev)
    for name, mod in (("old", old_rms), ("new", new_rms), ("old2", old_rms), ("new2", new_rms)):
        res[f"rmsnorm T={T} {name}"] = graph_us(lambda mod=mod: [mod.rms_norm(x[i], w, 1e-6, r[i]) for i in range(28)])
    a = new_rms.rms_norm(x[0], w, 1e-6, r[0]); b = old_rms.rms_norm(x[0], w, 1e-6, r[0])
    assert all(torch.equal(p, q) for p, q in zip(a, b)), "rmsnorm bits"
    # q/k norm + rotary + KV write: 16 q heads, 8 kv heads, d 128, in place on a qkv view
    qkv = [torch.randn(T, 32 * 128, dtype=bf, device=dev) for _ in range(28)]
    qw, kw = torch.randn(128, dtype=bf, device=dev), torch.randn(128, dtype=bf, device=dev)
    cos_sin = torch.randn(4096, 128, dtype=torch.float32, device=dev)
    pos = torch.randint(0, 4096, (T,), device=dev)
    cache = torch.zeros(2, 2048, 16, 8, 128, dtype=bf, device=dev)
    slots = torch.randperm(2048 * 16, device=dev)[:T]
    def qk(mod, i):
        v = qkv[i].view(T, 32, 128)
        mod.qk_norm_rotary(pos, v[:, :16], v[:, 16:24], qw, kw, 1e-6, cos_sin, True, v[:, 24:], cache, slots)
    for name, mod in (("old", old_qk), ("new", new_qk), ("old2", old_qk), ("new2", new_qk)):
        res[f"qk_norm_rotary T={T} {name}"] = graph_us(lambda mod=mod: [qk(mod, i) for i in range(28)])
    base = torch.randn(T, 32 * 128, dtype=bf, device=dev)
    c1, c2 = cache.clone(), cache.clone()
    q1, q2 = base.clone().view(T, 32, 128), base.clone().view(T, 32, 128)
    old_qk.qk_norm_rotary(pos, q1[:, :16], q1[:, 16:24], qw, kw, 1e-6, cos_sin, True, q1[:, 24:], c1, slots)
    new_qk.qk_norm_rotary(pos, q2[:, :16], q2[:, 16:24], qw, kw, 1e-6, cos_sin, True, q2[:, 24:], c2, slots)
    assert torch.equal(q1, q2) and torch.equal(c1, c2), "qk_norm_rotary bits"
    # the decode graph's inputs: n rows into a 256-row bucket, 256 blocks a row
    buf = torch.randint(0, 1000, (5 * T + T * 64,), device=dev)
    src = DecodeInputs(buf[:T], buf[T:2*T], buf[2*T:3*T], buf[3*T:4*T].to(torch.int32), buf[4*T:5*T], buf[5*T:].view(T, 64).to(torch.int32))
    dst = DecodeInputs(*(torch.zeros(256, dtype=torch.long, device=dev) for _ in range(3)), torch.zeros(256, dtype=torch.int32, device=dev), torch.zeros(256, dtype=torch.long, device=dev), torch.zeros(256, 256, dtype=torch.int32, device=dev))
    size = T + 4 if T < 256 else T
    res[f"decode inputs n={T} torch copies"] = graph_us(lambda: decode_inputs_ref(src, dst, size), 1)
    res[f"decode inputs n={T} one kernel"] = graph_us(lambda: copy_decode_inputs(src, dst, size), 1)
    print(json.dumps({k: round(v, 2) for k, v in res.items() if f"T={T}" in k or f"n={T}" in k}), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "small_ab.json"), "w"), indent=1)
