# syntax=docker/dockerfile:1
# Image of the node-agent (one per GPU node; NVML through nvidia-ml-py, or simulated with GPUORCH_NVML=sim).
# Build from the repository root (the uv workspace):
#   docker build -f deploy/docker/node-agent.Dockerfile -t gpuorch/node-agent .
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
    uv sync --frozen --no-dev --no-editable --package gpuorch-node-agent

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 gpuorch \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin gpuorch \
 && mkdir -p /var/lib/gpuorch/node-agent \
 && chown 10001:10001 /var/lib/gpuorch/node-agent
COPY --from=build /app/.venv /app/.venv
# GPUORCH_NODE_AGENT_STATE_DIR keeps the newest scheduler leader epoch per node: it must outlive the container.
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GPUORCH_NODE_AGENT_STATE_DIR=/var/lib/gpuorch/node-agent
# The NVIDIA Container Toolkit reads these: every GPU of the node, and only the driver's management library
# (libnvidia-ml.so.1) and nvidia-smi ("utility"): the agent inventories and watches GPUs, it runs no CUDA.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
WORKDIR /app
USER 10001:10001
VOLUME ["/var/lib/gpuorch/node-agent"]
ENTRYPOINT ["gpuorch-node-agent"]
