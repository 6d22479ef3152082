# The engine image for AMD GPUs (MI300X): `kvpilot serve` on the ROCm PyTorch image.
# torch and triton come from the base image and satisfy the engine's metadata; pip resolves
# the rest from the three distributions' metadata (kvpilot, kvpilot-kernels, kvpilot-engine).
# Build from the repository root:
#   docker build -f images/engine-rocm.Dockerfile -t ghcr.io/kvpilot/engine-rocm:0.1.0 .
FROM rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1 AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY operator operator
COPY kernels kernels
COPY engine engine
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ./kernels ./engine

FROM rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && mkdir -p /cache/huggingface /cache/triton \
    && chown -R 1000:1000 /cache
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
