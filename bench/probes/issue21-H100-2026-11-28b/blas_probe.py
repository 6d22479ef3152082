"""cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library) on Qwen3-0.6B's decode
projections, 28 layers of distinct weights in one CUDA graph, M rows."""
import torch, json, os
torch.manual_seed(0)
shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
W = {n: [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(28)] for n, (N, K) in shapes.items()}
out = {}
for lib in ("cublas", "cublaslt", "cublas"):
    torch.backends.cuda.preferred_blas_library(lib)
    for M in (16, 64, 96, 128, 192, 256):
        xs = {n: torch.randn(M, K, dtype=torch.bfloat16, device="cuda") for n, (N, K) in shapes.items()}
        for n in shapes:
            def body():
                for w in W[n]:
                    torch.nn.functional.linear(xs[n], w)
            body(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            for _ in range(3): g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            ts = []
            for _ in range(5):
                e0.record()
                for _ in range(20): g.replay()
                e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 20 / 28 * 1e3)
            ts.sort()
            out.setdefault(f"{lib}", {})[f"{n} M={M}"] = round(ts[2], 2)
    print(lib, json.dumps(out[lib]), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "blas.json"), "w"), indent=1)
