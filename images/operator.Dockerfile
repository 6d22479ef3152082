# The operator image: the kopf operator and the torch-free router (`kvpilot route`).
# It installs the `kvpilot` distribution (root pyproject.toml) with the dependencies its
# metadata lists: no torch, no triton. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvpilot/operator:0.1.0 .
FROM python:3.12-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY operator operator
COPY engine/torch_free engine/torch_free
# kvpilot and every dependency as wheels, resolved from kvpilot's own metadata.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
USER 1000:1000
ENTRYPOINT ["kvpilot"]
CMD ["operator"]
