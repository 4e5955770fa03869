"""Executor configuration, read from environment variables (``ExecutorConfig.from_env``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENVIRONMENT_HELP = """\
environment:
  GPUORCH_AMQP_URL              RabbitMQ URL (default amqp://guest:guest@127.0.0.1:5672/)
  GPUORCH_NODE_IDS              comma-separated node ids served by this process (fleet/simulation mode)
  GPUORCH_NODE_ID               the node id when serving one node (default: the host name)
  GPUORCH_EXECUTOR_STATE_DIR    state root; each node uses <root>/<node_id> (default ./var/executor)
  GPUORCH_EXECUTOR_BACKEND      runtimes enabled here: process, container or process,container (default process)
  GPUORCH_EXECUTOR_ALLOW        allow-list: inline JSON or the path of a JSON file (default: tenant 'default'
                                may run python and python3); see the README
  GPUORCH_EXECUTOR_DOCKER       docker CLI of the container backend, resolved to an absolute path at start on
                                the executor's PATH (default docker); jobs' environments never change it
  GPUORCH_EXECUTOR_JOB_UIDS     uids process jobs run as, one per job: first-last (default 61000-61063 when
                                the executor may switch users, i.e. runs as root; else off) or 'off' (jobs run
                                as the executor's user: reported in gpuctl nodes)
  GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT  where process jobs get the cgroup that confines them to their GPUs:
                                'auto' (default: cgroup v2 eBPF device filter, else cgroup v1 devices), a
                                directory, or 'off' (reported: devices env_only)
  GPUORCH_EXECUTOR_GPU_DEVICES  JSON {"<GPU uuid>": ["/dev/nvidiaN"]} in GPU index order (default: read from /proc/driver/nvidia)
  GPUORCH_EXECUTOR_CGROUP_ROOT  cgroup v2 directory for per-job limits (default /sys/fs/cgroup/gpuorch; without
                                cgroup v2, cgroup v1 memory and cpu under <hierarchy>/gpuorch); 'off' disables
                                limits
  GPUORCH_FENCING_DEADLINE_S    every job is dead when the lease went unrenewed this long (default 60); the
                                scheduler's lost-after must exceed it
  GPUORCH_FENCING_GRACE_S       the fence sends checkpoint signals this long before the deadline (default 10)
  GPUORCH_EXECUTOR_HEARTBEAT_S  seconds between ExecutorHeartbeats, the executor's lease renewals (default 5,
                                at most (deadline - grace) / 2)
  GPUORCH_EXECUTOR_POLL_S       watch interval of exit files, kills and max runtimes (default 0.1)
  GPUORCH_LOG_LEVEL             DEBUG, INFO, WARNING... (default INFO)
  GPUORCH_OTLP_ENDPOINT         OTLP/HTTP collector base URL for traces (default: no export)
  GPUORCH_METRICS_PORT          Prometheus /metrics port (default 0: off)
"""


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ExecutorConfig:
    amqp_url: str
    node_ids: tuple[str, ...]
    state_root: Path
    runtimes: tuple[str, ...]
    allow: str | None
    docker: str
    cgroup_root: str
    job_uids: str
    """``first-last``, ``off``, or ``auto`` (a default pool when this process may switch users)."""
    device_cgroup_root: str
    gpu_devices: str | None
    fencing_deadline_s: float
    fencing_grace_s: float
    heartbeat_s: float
    poll_interval_s: float
    log_level: str
    otlp_endpoint: str | None
    metrics_port: int

    def state_dir(self, node_id: str) -> Path:
        return self.state_root / node_id

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExecutorConfig:
        env = os.environ if env is None else env
        raw_nodes = env.get("GPUORCH_NODE_IDS") or env.get("GPUORCH_NODE_ID") or socket.gethostname()
        node_ids = tuple(n.strip() for n in raw_nodes.split(",") if n.strip())
        if not node_ids or len(set(node_ids)) != len(node_ids):
            raise ConfigError(f"GPUORCH_NODE_IDS must list distinct node ids, got {raw_nodes!r}")
        runtimes = tuple(r.strip() for r in env.get("GPUORCH_EXECUTOR_BACKEND", "process").split(",") if r.strip())
        unknown = set(runtimes) - {"process", "container"}
        if unknown or not runtimes:
            raise ConfigError(f"GPUORCH_EXECUTOR_BACKEND: unknown runtimes {sorted(unknown)}")
        deadline = _float(env, "GPUORCH_FENCING_DEADLINE_S", 60.0)
        if deadline <= 0:
            raise ConfigError("GPUORCH_FENCING_DEADLINE_S must be positive")
        grace = min(_float(env, "GPUORCH_FENCING_GRACE_S", min(10.0, deadline / 2)), deadline)
        heartbeat = _float(env, "GPUORCH_EXECUTOR_HEARTBEAT_S", min(5.0, (deadline - grace) / 3))
        if heartbeat <= 0 or heartbeat * 2 > deadline - grace:
            raise ConfigError("GPUORCH_EXECUTOR_HEARTBEAT_S must be positive and at most half of "
                              "GPUORCH_FENCING_DEADLINE_S - GPUORCH_FENCING_GRACE_S (one lost heartbeat must not fence)")
        return cls(
            amqp_url=env.get("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
            node_ids=node_ids,
            state_root=Path(env.get("GPUORCH_EXECUTOR_STATE_DIR", "./var/executor")),
            runtimes=runtimes,
            allow=env.get("GPUORCH_EXECUTOR_ALLOW"),
            docker=env.get("GPUORCH_EXECUTOR_DOCKER", "docker"),
            cgroup_root=env.get("GPUORCH_EXECUTOR_CGROUP_ROOT", "/sys/fs/cgroup/gpuorch"),
            job_uids=env.get("GPUORCH_EXECUTOR_JOB_UIDS", "auto"),
            device_cgroup_root=env.get("GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT", "auto"),
            gpu_devices=env.get("GPUORCH_EXECUTOR_GPU_DEVICES") or None,
            fencing_deadline_s=deadline,
            fencing_grace_s=grace,
            heartbeat_s=heartbeat,
            poll_interval_s=_float(env, "GPUORCH_EXECUTOR_POLL_S", 0.1),
            log_level=env.get("GPUORCH_LOG_LEVEL", "INFO"),
            otlp_endpoint=env.get("GPUORCH_OTLP_ENDPOINT") or None,
            metrics_port=int(env.get("GPUORCH_METRICS_PORT", "0")),
        )


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name, default))
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number") from exc
