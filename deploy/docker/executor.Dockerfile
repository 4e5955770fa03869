# syntax=docker/dockerfile:1
# Image of the executor (one per GPU node). Build from the repository root (the uv workspace):
#   docker build -f deploy/docker/executor.Dockerfile -t gpuorch/executor .                       # process backend
#   docker build -f deploy/docker/executor.Dockerfile --target container -t gpuorch/executor:docker .
# Default target (last stage, "process"): jobs run as processes inside this container, each in its own process
# group under a supervisor, with CUDA_VISIBLE_DEVICES set to the GPU/MIG UUIDs they were given.
# Target "container": adds the docker CLI, so GPUORCH_EXECUTOR_BACKEND=container can drive the host's Docker
# engine through its socket (mounted at run time: /var/run/docker.sock) and start each job as its own hardened
# container with --gpus device=<UUIDs> (the host needs the NVIDIA Container Toolkit). Whoever can use that socket
# is root on the host: this target runs no process job (a job inside this container could reach the socket), and
# asks the toolkit for no GPU (NVIDIA_VISIBLE_DEVICES=void: each job's container gets exactly its own).
# Process target: the executor hands each job a uid of its own when it runs as root with CAP_SETUID/CAP_SETGID
# (deploy/k8s/executor.yaml); as uid 10001 it cannot, and its nodes say so (gpuctl nodes: executor's uid).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9
ARG DOCKER_CLI_IMAGE=docker:27-cli

FROM ${UV_IMAGE} AS uv
FROM ${DOCKER_CLI_IMAGE} AS docker-cli

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
    uv sync --frozen --no-dev --no-editable --package gpuorch-executor

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 gpuorch \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin gpuorch \
 && mkdir -p /var/lib/gpuorch/executor \
 && chown 10001:10001 /var/lib/gpuorch/executor
COPY --from=build /app/.venv /app/.venv
# Jobs started by the process backend inherit this environment: "python" is the venv's interpreter.
# The NVIDIA Container Toolkit reads NVIDIA_*: every GPU of the node, with the driver libraries that CUDA jobs
# need (compute) and NVML (utility); the executor narrows each job to its own GPUs with CUDA_VISIBLE_DEVICES.
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GPUORCH_EXECUTOR_STATE_DIR=/var/lib/gpuorch/executor \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
USER 10001:10001
VOLUME ["/var/lib/gpuorch/executor"]
# Prometheus /metrics when GPUORCH_METRICS_PORT=9101 (the executor's default is 0: off)
EXPOSE 9101
ENTRYPOINT ["gpuorch-executor"]

FROM runtime AS container
COPY --from=docker-cli /usr/local/bin/docker /usr/local/bin/docker
ENV GPUORCH_EXECUTOR_BACKEND=container \
    GPUORCH_EXECUTOR_DOCKER=/usr/local/bin/docker \
    NVIDIA_VISIBLE_DEVICES=void

FROM runtime AS process
