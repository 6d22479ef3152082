# Sourced by the GPU run scripts on a lent device machine (no package index there):
# keeps NVLink multicast off, installs the carried wheels (.whl/, made with `pip download
# --python-version 3.12 ...`, see docs/decisions/0022) into /tmp/site and puts the code
# folders on PYTHONPATH (kvpilot and kvpilot.engine are namespace packages; the torch-free
# contracts and router live in engine/torch_free since issue 47).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && [ ! -f /tmp/site/.kvpilot-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -2
    touch /tmp/site/.kvpilot-wheels
fi
export PYTHONPATH="$PWD/operator:$PWD/engine:$PWD/engine/torch_free:$PWD/kernels:$PWD/cli:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# autotuned kernels (the one-row GEMV, the 8-bit GEMM) keep their timings in Triton's disk cache,
# so each later process of a call (every engine rank, every GPU test) reuses them instead of
# timing every config again; older Triton ignores the variable
export TRITON_CACHE_AUTOTUNING=1
