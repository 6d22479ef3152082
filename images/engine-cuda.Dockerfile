# The engine image for NVIDIA GPUs: `kvpilot serve` on the PyTorch CUDA runtime image.
# torch and triton come from the base image and satisfy the engine's metadata; pip resolves
# the rest from the three distributions' metadata (kvpilot, kvpilot-kernels, kvpilot-engine).
# Build from the repository root:
#   docker build -f images/engine-cuda.Dockerfile -t ghcr.io/kvpilot/engine:0.1.0 .
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY operator operator
COPY kernels kernels
COPY engine engine
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . ./kernels ./engine

FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
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
