# syntax=docker/dockerfile:1
# Image of the API (any number of instances: HTTP API and dashboard, no state of its own).
# Build from the repository root (the uv workspace):
#   docker build -f deploy/docker/api.Dockerfile -t gpuorch/api .
# Stage 1 syncs the locked dependencies of one workspace member into /app/.venv (non-editable, so the venv needs
# no source tree); stage 2 is a slim runtime with that venv only, run as an unprivileged user.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${PYTHON_IMAGE} AS build
COPY --from=uv /uv /bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs libs
COPY services services
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --package gpuorch-api

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 gpuorch \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin gpuorch
COPY --from=build /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /app
USER 10001:10001
# HTTP: API, /openapi.json, /healthz, /readyz and the dashboard (GPUORCH_API_PORT, default 8080)
EXPOSE 8080
ENTRYPOINT ["gpuorch-api"]
