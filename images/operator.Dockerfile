# The operator image: kopf operator and the torch-free router (`kvpilot route`). No torch.
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvpilot/operator:0.1.0 .
FROM python:3.12-slim-bookworm AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY images/operator-requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=build /wheels /wheels
# --no-deps: kvpilot's own metadata lists torch for the engine; this image never imports it.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels /tmp/requirements.txt
USER 1000:1000
ENTRYPOINT ["kvpilot"]
CMD ["operator"]
