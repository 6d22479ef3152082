# The engine image for AMD GPUs (MI300X): `kvpilot serve` on the ROCm PyTorch image
# (torch and triton come from the base). Build from the repository root:
#   docker build -f images/engine-rocm.Dockerfile -t ghcr.io/kvpilot/engine-rocm:0.1.0 .
FROM rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1 AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM rocm/pytorch:rocm6.4.1_ubuntu24.04_py3.12_pytorch_release_2.7.1
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton
COPY images/engine-requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=build /wheels /wheels
# --no-deps: torch and triton are the base image's; the rest came from the pinned list above.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels /tmp/requirements.txt \
    && mkdir -p /cache/huggingface /cache/triton \
    && chown -R 1000:1000 /cache
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
