"""Executor configuration (``ExecutorConfig``): environment variables, or keys of an optional TOML/JSON file under
them (``--config`` / ``GPUORCH_CONFIG_FILE``), validated at start (``gpuorch_settings``; ``gpuorch-executor
--help`` lists them). ``ExecutorConfig.from_env(env)`` raises ``ConfigError`` naming each invalid variable."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from gpuorch_messaging import BrokerSettings
from gpuorch_settings import SettingsError, setting
from pydantic import PrivateAttr, model_validator


class ConfigError(ValueError):
    pass


class ExecutorConfig(BrokerSettings):
    amqp_url: str = setting("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL")
    node_ids_text: str = setting("GPUORCH_NODE_IDS", "", "comma-separated node ids served by this process "
                                 "(fleet/simulation mode)")
    node_id: str = setting("GPUORCH_NODE_ID", "", "the node id when serving one node (default: the host name)")
    state_root: Path = setting("GPUORCH_EXECUTOR_STATE_DIR", Path("./var/executor"), "state root; each node uses "
                               "<root>/<node_id>")
    backend: str = setting("GPUORCH_EXECUTOR_BACKEND", "process", "runtimes enabled here: process, container or "
                           "process,container")
    allow: str | None = setting("GPUORCH_EXECUTOR_ALLOW", None, "allow-list: inline JSON or the path of a JSON "
                                "file (default: tenant 'default' may run python and python3); see the README")
    docker: str = setting("GPUORCH_EXECUTOR_DOCKER", "docker", "docker CLI of the container backend, resolved to "
                          "an absolute path at start on the executor's PATH; jobs' environments never change it")
    job_uids: str = setting("GPUORCH_EXECUTOR_JOB_UIDS", "auto", "uids process jobs run as, one per job: "
                            "first-last, 'off' (jobs run as the executor's user: reported in gpuctl nodes) or "
                            "'auto' (61000-61063 when the executor may switch users, i.e. runs as root; else off)")
    unsandboxed: bool = setting("GPUORCH_EXECUTOR_UNSANDBOXED", False, "operator's opt-out: without a job uid "
                                "pool, run process jobs as the executor's own user (or root) instead of refusing to "
                                "start; logged at start and at every launch. For demos and tests only")
    device_cgroup_root: str = setting("GPUORCH_EXECUTOR_DEVICE_CGROUP_ROOT", "auto", "where process jobs get the "
                                      "cgroup that confines them to their GPUs: 'auto' (cgroup v2 eBPF device "
                                      "filter, else cgroup v1 devices), a directory, or 'off' (devices env_only)")
    gpu_devices: str | None = setting("GPUORCH_EXECUTOR_GPU_DEVICES", None, 'JSON {"<GPU uuid>": ["/dev/nvidiaN"]} '
                                      "in GPU index order (default: read from /proc/driver/nvidia)")
    cgroup_root: str = setting("GPUORCH_EXECUTOR_CGROUP_ROOT", "/sys/fs/cgroup/gpuorch", "cgroup v2 directory for "
                               "per-job limits (without cgroup v2, cgroup v1 memory and cpu under "
                               "<hierarchy>/gpuorch); 'off' disables limits")
    fencing_deadline_s: float = setting("GPUORCH_FENCING_DEADLINE_S", 60.0, "every job is dead when the lease "
                                        "went unrenewed this long; the scheduler's lost-after must exceed it", gt=0)
    fencing_grace_setting: float | None = setting("GPUORCH_FENCING_GRACE_S", None, "the fence sends checkpoint "
                                                  "signals this long before the deadline (default: min(10, "
                                                  "deadline / 2))", ge=0)
    heartbeat_setting: float | None = setting("GPUORCH_EXECUTOR_HEARTBEAT_S", None, "seconds between "
                                              "ExecutorHeartbeats, the executor's lease renewals (default: "
                                              "min(5, (deadline - grace) / 3); at most (deadline - grace) / 2)", gt=0)
    poll_interval_s: float = setting("GPUORCH_EXECUTOR_POLL_S", 0.1, "watch interval of exit files, kills and max "
                                     "runtimes", gt=0)
    gpu_memory_probe: str = setting("GPUORCH_EXECUTOR_GPU_MEMORY_PROBE", "auto", "how the share watchdog reads a "
                                    "job's GPU memory: nvml, declared (GPUORCH_SIM_USAGE, the simulated fleet), off "
                                    "(shares are not watched) or auto (nvml where NVML initialises, else declared)",
                                    pattern="^(auto|nvml|declared|off)$")
    share_tolerance_pct: float = setting("GPUORCH_EXECUTOR_SHARE_TOLERANCE_PCT", 10.0, "a share job may hold this "
                                         "much (percent of its share, at least 64 MiB) more GPU memory than its "
                                         "share before the watchdog counts it as over", ge=0, le=1000)
    share_sustain_s: float = setting("GPUORCH_EXECUTOR_SHARE_SUSTAIN_S", 3.0, "a share job over its GPU memory "
                                     "this long is stopped (gpu_memory_exceeded)", ge=0, le=3600)
    mps_pipe_directory: str = setting("GPUORCH_EXECUTOR_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps", "where the node's "
                                      "MPS control daemon listens (its CUDA_MPS_PIPE_DIRECTORY); while it runs, "
                                      "share jobs start as MPS clients with their memory and thread limits; 'off': "
                                      "never (docs/sharing.md)")
    sessions_dir: Path | None = setting("GPUORCH_EXECUTOR_SESSIONS_DIR", None, "work directories of interactive "
                                        "sessions, kept across parks (shared storage when sessions may resume on "
                                        "another host; default <state root>/sessions)")
    metrics_port: int = setting("GPUORCH_METRICS_PORT", 0, "port of /metrics, /healthz and /readyz (0: off)",
                                ge=0, le=65535)

    _node_ids: tuple[str, ...] = PrivateAttr(default=())
    _runtimes: tuple[str, ...] = PrivateAttr(default=())
    _grace: float = PrivateAttr(default=0.0)
    _heartbeat: float = PrivateAttr(default=0.0)

    @model_validator(mode="after")
    def _derive(self) -> ExecutorConfig:
        raw_nodes = self.node_ids_text or self.node_id or socket.gethostname()
        node_ids = tuple(n.strip() for n in raw_nodes.split(",") if n.strip())
        if not node_ids or len(set(node_ids)) != len(node_ids):
            raise ValueError(f"GPUORCH_NODE_IDS must list distinct node ids, got {raw_nodes!r}")
        runtimes = tuple(r.strip() for r in self.backend.split(",") if r.strip())
        unknown = set(runtimes) - {"process", "container"}
        if unknown or not runtimes:
            raise ValueError(f"GPUORCH_EXECUTOR_BACKEND: unknown runtimes {sorted(unknown)}")
        deadline = self.fencing_deadline_s
        grace = min(self.fencing_grace_setting if self.fencing_grace_setting is not None
                    else min(10.0, deadline / 2), deadline)
        heartbeat = self.heartbeat_setting if self.heartbeat_setting is not None else min(5.0, (deadline - grace) / 3)
        if heartbeat <= 0 or heartbeat * 2 > deadline - grace:
            raise ValueError("GPUORCH_EXECUTOR_HEARTBEAT_S must be positive and at most half of "
                             "GPUORCH_FENCING_DEADLINE_S - GPUORCH_FENCING_GRACE_S (one lost heartbeat must not "
                             "fence)")
        self._node_ids, self._runtimes, self._grace, self._heartbeat = node_ids, runtimes, grace, heartbeat
        return self

    @property
    def node_ids(self) -> tuple[str, ...]:
        return self._node_ids

    @property
    def runtimes(self) -> tuple[str, ...]:
        return self._runtimes

    @property
    def fencing_grace_s(self) -> float:
        return self._grace

    @property
    def heartbeat_s(self) -> float:
        return self._heartbeat

    def state_dir(self, node_id: str) -> Path:
        return self.state_root / node_id

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, file: str | Path | None = None) -> ExecutorConfig:
        """``load`` (environment, optional file), raising ``ConfigError`` with one line per invalid variable."""
        try:
            return cls.load(env, file)
        except SettingsError as exc:
            raise ConfigError(str(exc)) from exc
