"""Which all-reduce a tensor-parallel group runs for one tensor, and whether the fast one
can run at all: the rules, as functions of sizes, world size and dtype (no GPU needed).

NCCL's all-reduce costs ~18 us even for a decode step's few KB (measured on H100s, inside a
CUDA graph), 64 times a token on a 32-layer model. For such small messages a group on one
host with peer-to-peer access runs the all-reduce over torch symmetric memory instead
(vLLM's custom all-reduce does the same over its own IPC buffers): every rank copies its
tensor into a buffer its peers can read, then

- one-shot: each rank reads every peer's whole buffer and sums (one kernel, the copy
  fused in): lowest latency, world_size x the bytes read per rank;
- two-shot: each rank sums its 1/world_size slice from every peer, then gathers the
  summed slices (reduce-scatter + all-gather): half the traffic at 4+ ranks, two steps.

vLLM's rule (custom_all_reduce.cuh): one-shot at 2 ranks for every size; at 4 ranks below
512 KiB, at 8 ranks below 256 KiB; two-shot above. Messages larger than the buffer, dtypes
torch's kernels do not dispatch (they take bfloat16 and float32), and tensors that are not
contiguous and 16-byte aligned go over NCCL. NVLink multicast (torch's multimem_* ops) is
never used: the machines this runs on keep it off.
"""

from __future__ import annotations

import torch

ONE_SHOT, TWO_SHOT, NCCL = "one-shot", "two-shot", "nccl"
WORLD_SIZES = (2, 4, 8)  # the sizes torch's symm_mem all-reduce kernels are built for
DTYPES = (torch.bfloat16, torch.float32)  # what those kernels dispatch on
ALIGNMENT = 16  # bytes: offset and size, so the copied tensor and the buffer align alike
# the auto-sized buffer's ceiling: vLLM's custom all-reduce's default max size; past it a
# message is bandwidth-bound and NCCL's ring does as well
AUTO_MAX_BYTES = 8 * 1024 * 1024
# one-shot below these many bytes at (up to) this many ranks; two-shot from there
ONE_SHOT_LIMITS = ((2, None), (4, 512 * 1024), (8, 256 * 1024))
# the torch ops the path calls (torch.ops.symm_mem.*); missing any: NCCL, said at start-up
OPS = ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out")


def buffer_bytes(max_bytes: int, max_num_seqs: int, hidden_size: int,
                 dtype: torch.dtype) -> int:
    """Gives the symmetric buffer's size: `max_bytes` (--custom-all-reduce-max-bytes) when set,
    else one decode step's activations (max_num_seqs x hidden_size x dtype size) up to
    AUTO_MAX_BYTES; rounded up to the alignment."""
    size = max_bytes or min(max_num_seqs * hidden_size * dtype.itemsize, AUTO_MAX_BYTES)
    return -(-size // ALIGNMENT) * ALIGNMENT


def one_shot_below(world_size: int) -> int | None:
    """Gives the message size from which `world_size` ranks use two-shot (None: never)."""
    for ranks, limit in ONE_SHOT_LIMITS:
        if world_size <= ranks:
            return limit
    raise ValueError(f"world_size={world_size} has no symmetric-memory all-reduce: "
                     f"one of {WORLD_SIZES}")


def choose(x: torch.Tensor, world_size: int, capacity: int) -> str:
    """Gives the all-reduce `x` takes on a group whose symmetric buffer holds `capacity`
    bytes: ONE_SHOT, TWO_SHOT, or NCCL (too large, another dtype, or not aligned)."""
    nbytes = x.numel() * x.element_size()
    if (nbytes == 0 or nbytes > capacity or x.dtype not in DTYPES or not x.is_contiguous()
            or nbytes % ALIGNMENT or (x.storage_offset() * x.element_size()) % ALIGNMENT):
        return NCCL
    limit = one_shot_below(world_size)
    return ONE_SHOT if limit is None or nbytes < limit else TWO_SHOT


def why_not(*, disabled: bool, device_type: str, world_size: int, dtype: torch.dtype,
            rocm: bool = False) -> str | None:
    """Gives why the flags, the device and the model rule the symmetric-memory all-reduce
    out (None: they do not), in words a start-up log line can carry."""
    if disabled:
        return "--disable-custom-all-reduce is set"
    if device_type != "cuda":
        return f"device {device_type}: symmetric memory needs CUDA GPUs"
    if rocm:
        return "ROCm: the symmetric-memory all-reduce is built and checked for NVIDIA GPUs only"
    if world_size not in WORLD_SIZES:
        return f"tensor_parallel_size={world_size}: torch's kernels take {WORLD_SIZES} ranks"
    if dtype not in DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}: torch's kernels take bfloat16 " \
               "and float32"
    return None


def why_not_here(*, one_host: bool, missing_ops: list[str],
                 no_peer_access: list[int]) -> str | None:
    """Gives why what this rank sees of its host and its torch rules the path out (None:
    nothing does)."""
    if not one_host:
        return "the tensor-parallel group spans nodes: peer memory needs one host"
    if missing_ops:
        return f"this torch ({torch.__version__}) lacks torch.ops.symm_mem." \
               f"{', '.join(missing_ops)}"
    if no_peer_access:
        return f"no peer-to-peer access to GPU(s) {no_peer_access}"
    return None
