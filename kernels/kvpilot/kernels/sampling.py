"""Random sampling at temperature T in one read of the logits: the Gumbel-max trick.

Row r samples ``argmax_v(logit_v / T + g_v)`` with ``g_v = -log(-log u_v)`` and ``u_v``
uniform on (0, 1): adding Gumbel noise to the scaled logits picks ``v`` with probability
``softmax(logits / T)_v``. It is the distribution of the torch path's exponential race
(``Sampler._sample_random``: ``argmax p_v / E_v`` with ``E_v ~ Exp(1)`` is ``argmax logit_v / T
- log E_v``, and ``-log u ~ Exp(1)``), without the softmax, the temperature-scaled copy or the
noise tensor: each logit is loaded once, widened to float32, and never written back.

Noise: Philox (``tl.rand4x``), one stream per row keyed by ``seed + row``, where ``seed`` is
loaded from a device tensor (drawing it never waits for the GPU). One Philox call gives four
uniforms, used by the four quarters of a chunk: column ``chunk * BLOCK + q * BLOCK / 4 + j`` takes
output ``q`` of counter ``chunk * BLOCK / 4 + j`` (`kernel_uniforms` gives the same numbers with
numpy). With ``v`` that uniform in [0, 1) and ``u = 1 - v``, ``E = -log u = -log1p(-v)`` is taken
as ``v + v^2/2 + v^3/3`` below 1/64: the small ``E`` that decide a winner keep every bit of ``v``,
where ``-log(1 - v)`` in float32 would round them (and give ``E = 0`` below 2^-25). ``v`` is
clamped into [2^-32, 1 - 2^-24], so ``E`` is finite and nonzero. Keys are in base 2, ``logit *
log2(e) / T - log2(log2(e) * E)`` (a positive multiple of the natural key, shifted by a
constant: the same argmax); on NVIDIA GPUs both logarithms are PTX's ``lg2.approx``, which
halves the kernel's time against libdevice's (143 -> 82 us for 256 rows of 151936 on an H100).

A row with ``T == 0`` is greedy: its key is the raw logit, no noise, and the first index of
the row's max wins, as ``torch.argmax``. A -inf logit (a grammar's mask, a banned token) has
key -inf and loses to any finite one; a row of -inf only gives an index inside the row.

Pass 1 runs one program per (row, chunk of BLOCK columns; 4096 cuts a 151936 vocabulary into
38) and writes the chunk's best key and the first column holding it. Pass 2 is torch's argmax
over the [N, chunks] keys (the first chunk holding the row's best) and a gather: ties go to
the lowest column.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit

DEFAULT_BLOCK = 4096


@jit
def _log2(x, APPROX: tl.constexpr):
    if APPROX:  # PTX's lg2.approx (~2^-22 absolute error): one MUFU op, not libdevice's ~20
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.log2(x)


@jit
def _keys(base, cols, vocab, v, sampled, scale, APPROX_LOG: tl.constexpr):
    """Gives the keys of the logits at `cols`, `v` their uniforms (the module docstring)."""
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    v = tl.minimum(tl.maximum(v, 2.3283064365386963e-10), 0.99999994)  # [2^-32, 1 - 2^-24]
    # log2(e) * E = -log2(1 - v); below 1/64 its series, exact where 1 - v would round
    e = tl.where(v < 0.015625,
                 v * (1.4426950408889634 + v * (0.7213475204444817 + v * 0.48089834696298783)),
                 -_log2(1.0 - v, APPROX_LOG))
    return tl.where(sampled, x * scale - _log2(e, APPROX_LOG), x)


@jit
def _gumbel_chunk_kernel(logits_ptr, temperature_ptr, seed_ptr, key_ptr, index_ptr,
                         stride_l, vocab, num_chunks,
                         BLOCK: tl.constexpr, APPROX_LOG: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    QUARTER: tl.constexpr = BLOCK // 4
    offs = tl.arange(0, QUARTER)
    t = tl.load(temperature_ptr + row)
    sampled = t > 0.0
    scale = 1.4426950408889634 / tl.where(sampled, t, 1.0)  # log2(e) / T
    v0, v1, v2, v3 = tl.rand4x(tl.load(seed_ptr) + row, chunk * QUARTER + offs)
    base = logits_ptr + row.to(tl.int64) * stride_l
    cols = chunk * BLOCK + offs
    # per lane j, the best of columns j, j + Q, j + 2Q, j + 3Q (Q = BLOCK / 4) and the first
    # column holding it: later quarters replace it only with a strictly larger key
    best = _keys(base, cols, vocab, v0, sampled, scale, APPROX_LOG)
    at = cols
    key = _keys(base, cols + QUARTER, vocab, v1, sampled, scale, APPROX_LOG)
    at = tl.where(key > best, cols + QUARTER, at)
    best = tl.maximum(best, key)
    key = _keys(base, cols + 2 * QUARTER, vocab, v2, sampled, scale, APPROX_LOG)
    at = tl.where(key > best, cols + 2 * QUARTER, at)
    best = tl.maximum(best, key)
    key = _keys(base, cols + 3 * QUARTER, vocab, v3, sampled, scale, APPROX_LOG)
    at = tl.where(key > best, cols + 3 * QUARTER, at)
    best = tl.maximum(best, key)
    top = tl.max(best, 0)
    # the first column holding the chunk's best key (the chunk's first if every key is -inf)
    at = tl.min(tl.where(best == top, at, chunk * BLOCK + BLOCK), 0)
    tl.store(key_ptr + row * num_chunks + chunk, top)
    tl.store(index_ptr + row * num_chunks + chunk, tl.minimum(at, vocab - 1).to(tl.int64))


def _block(vocab: int, block: int | None) -> int:
    block = block or min(DEFAULT_BLOCK, max(64, triton.next_power_of_2(vocab)))
    if block < 4 or block & (block - 1):
        raise ValueError(f"block={block} is invalid: give a power of two >= 4")
    return block


def gumbel_max_sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                      block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Gives one token id per row of `logits` [N, vocab] (bf16, fp16 or fp32), long [N]: a draw
    from softmax(logits / T) with T from `temperature` (float32 [N]; 0: the row's argmax), the
    noise keyed by `seed` (int64 [1]); all three on one device."""
    n, vocab = logits.shape
    if temperature.shape != (n,) or seed.numel() != 1:
        raise ValueError(f"temperature {tuple(temperature.shape)} / seed "
                         f"{tuple(seed.shape)}: give float32 [{n}] and int64 [1]")
    if logits.stride(1) != 1:  # a row's columns must be dense; rows may be strided
        logits = logits.contiguous()
    block = _block(vocab, block)
    chunks = triton.cdiv(vocab, block)
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    keys = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(n, chunks, dtype=torch.long, device=logits.device)
    _gumbel_chunk_kernel[(n, chunks)](
        logits, temperature, seed, keys, index, logits.stride(0), vocab, chunks,
        BLOCK=block, APPROX_LOG=_approx_log(logits.device), num_warps=num_warps)
    # pass 2 on [N, chunks]: the first chunk with the row's best key (NaN keys: torch's argmax
    # takes them as the max, still a chunk of the row)
    return index.gather(1, keys.argmax(dim=1, keepdim=True))[:, 0]


def _approx_log(device: torch.device) -> bool:
    """Whether the kernel may use PTX's lg2.approx: NVIDIA's compiler, not the interpreter."""
    return (device.type == "cuda" and torch.version.hip is None
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


# Philox-4x32-10 as `tl.rand4x` computes it (triton/language/random.py)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_M32 = np.uint64(0xFFFFFFFF)


def _philox4x32(keys: np.ndarray, counters: np.ndarray) -> list[np.ndarray]:
    """Gives Philox's four uint32 outputs (as uint64 [rows, counters]) for counters
    (`counters`, 0, 0, 0) under 64-bit keys `keys` (one per row)."""
    shape = (len(keys), len(counters))
    c = [np.broadcast_to(counters.astype(np.uint64)[None, :], shape),
         *(np.zeros(shape, dtype=np.uint64) for _ in range(3))]
    k0 = (keys.astype(np.uint64) & _M32)[:, None]
    k1 = (keys.astype(np.uint64) >> np.uint64(32))[:, None]
    a, b = (np.uint64(x) for x in _PHILOX_ROUND)
    for _ in range(10):
        p0, p2 = a * c[0], b * c[2]  # < 2^64: exact in uint64
        c = [(p2 >> np.uint64(32)) ^ c[1] ^ k0, p2 & _M32,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _M32]
        k0 = (k0 + np.uint64(_PHILOX_KEY[0])) & _M32
        k1 = (k1 + np.uint64(_PHILOX_KEY[1])) & _M32
    return c


def kernel_uniforms(seed: int, rows: int, vocab: int, block: int | None = None) -> torch.Tensor:
    """Gives the u in (0, 1) that `gumbel_max_sample(..., seed=[seed], block=block)` draws for
    each of `rows` x `vocab` logits (float64 [rows, vocab], on the CPU), for its reference."""
    block = _block(vocab, block)
    quarter = block // 4
    chunks = triton.cdiv(vocab, block)
    keys = np.arange(rows, dtype=np.int64) + seed  # the kernel's `seed + row`
    words = _philox4x32(keys, np.arange(chunks * quarter, dtype=np.int64))
    quarters = []
    for w in words:  # uint_to_uniform_float, then the kernel's clamp
        x = w.astype(np.uint32).view(np.int32)
        v = np.where(x < 0, ~x, x).astype(np.float32) * np.float32(4.6566127342e-10)
        v = np.clip(v, np.float32(2.0**-32), np.float32(1 - 2.0**-24))
        quarters.append(1.0 - v.astype(np.float64).reshape(rows, chunks, quarter))
    # column chunk * block + q * quarter + j takes output q of counter chunk * quarter + j
    u = np.stack(quarters, axis=2).reshape(rows, chunks * block)[:, :vocab]
    return torch.from_numpy(np.ascontiguousarray(u))


def gumbel_max_sample_ref(logits: torch.Tensor, temperature: torch.Tensor,
                          uniforms: torch.Tensor) -> torch.Tensor:
    """Gives argmax(logits / T - log(-log u)) per row in float64 (`uniforms` u in (0, 1), [N,
    vocab]), or the raw argmax where T == 0."""
    return gumbel_max_keys(logits, temperature, uniforms).argmax(dim=-1)


def gumbel_max_keys(logits: torch.Tensor, temperature: torch.Tensor,
                    uniforms: torch.Tensor) -> torch.Tensor:
    """Gives the reference's float64 keys [N, vocab] (the raw logits on rows with T == 0)."""
    x = logits.double()
    t = temperature.double().to(x.device)[:, None]
    gumbel = -torch.log(-torch.log(uniforms.double().to(x.device)))
    return torch.where(t > 0, x / torch.where(t > 0, t, 1.0) + gumbel, x)
