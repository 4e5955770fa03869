"""The scheduler's settings (``gpuorch_settings``: environment variables, an optional TOML/JSON file under them,
validated at start; ``gpuorch-scheduler --help`` lists them).

Derived at load, and validated with the rest: ``queues`` (the quotas of ``GPUORCH_QUOTAS`` or
``GPUORCH_QUOTAS_FILE``, the ageing rate, the admission limits, and fair share over time: ``GPUORCH_FAIR_SHARE``
with the shares of the identity map) and ``identity_map`` (``GPUORCH_IDENTITY_MAP``,
or everyone an operator with ``GPUORCH_IDENTITY=trust_all``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from gpuorch_identity import IdentityMap, load_identity_map
from gpuorch_messaging import BrokerSettings
from gpuorch_policy.mig_execution import ExecutionSettings
from gpuorch_policy.mig_planner import PlannerSettings
from gpuorch_scheduling import LivenessPolicy
from gpuorch_scheduling.fairshare import FairSharePolicy
from gpuorch_scheduling.mig import MigControl
from gpuorch_scheduling.queueing import QueuePolicy
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.sessions import SessionPolicy, parse_park_by_tenant
from gpuorch_settings import setting
from pydantic import PrivateAttr, model_validator


class Settings(BrokerSettings):
    """``GPUORCH_IDENTITY`` and the broker's topology mode come with ``BrokerSettings``."""

    amqp_url: str = setting("GPUORCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL")
    database_url: str = setting("GPUORCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/gpuorch",
                                "PostgreSQL DSN")
    instance: str = setting("GPUORCH_SCHEDULER_ID", "scheduler-1", "name of this instance (logs, broker connection)")
    suspect_after_s: float = setting("GPUORCH_SUSPECT_AFTER_S", 15.0,
                                     "seconds without heartbeat before a node is suspect", gt=0)
    lost_after_s: float = setting("GPUORCH_LOST_AFTER_S", 90.0, "seconds without heartbeat before a node is lost "
                                  "(> executor fencing deadline)", gt=0)
    tick_s: float = setting("GPUORCH_TICK_S", 1.0, "seconds between liveness/scheduling ticks", gt=0)
    batch_max: int = setting("GPUORCH_BATCH_MAX", 500, "most messages handled in one transaction", ge=1)
    batch_wait_ms: float = setting("GPUORCH_BATCH_WAIT_MS", 20.0, "milliseconds a batch waits for more messages "
                                   "after its first", ge=0)
    batch_budget_ms: float = setting("GPUORCH_BATCH_BUDGET_MS", 10.0, "while several tenants submit, a batch "
                                     "holds about this much work (0: always GPUORCH_BATCH_MAX)", ge=0)
    relay_process: bool = setting("GPUORCH_RELAY_PROCESS", True, "publish the outbox from a process of its own "
                                  "(the other core); 0: in process")
    retention_s: float = setting("GPUORCH_RETENTION_S", 3600.0, "seconds a finished job stays in the scheduler's "
                                 "memory (the read model keeps it)", ge=0)
    identity_map_path: str = setting("GPUORCH_IDENTITY_MAP", "", "identity map (JSON): broker users -> tenants, "
                                     "default tenant, highest priority, role")
    quotas: str = setting("GPUORCH_QUOTAS", "", 'tenant quotas as JSON: {"team-a": {"gpus": 8, '
                          '"gpu_memory_mib": 655360}, "*": {"gpus": 2}}')
    quotas_file: str = setting("GPUORCH_QUOTAS_FILE", "", "path of a JSON file with the quotas (GPUORCH_QUOTAS "
                               "wins)")
    ageing_points_per_minute: float = setting("GPUORCH_AGEING_POINTS_PER_MINUTE", 1.0, "priority points a waiting "
                                              "job gains per minute (normal=100, high=500)", ge=0)
    max_queued_per_tenant: int = setting("GPUORCH_MAX_QUEUED_PER_TENANT", 10000, "a tenant's submissions are "
                                         "rejected while it has this many jobs waiting", ge=1)
    submissions_per_s: float = setting("GPUORCH_SUBMISSIONS_PER_S", 500.0, "each tenant's sustained submission "
                                       "rate; faster submissions are rejected", gt=0)
    submission_burst: int = setting("GPUORCH_SUBMISSION_BURST", 5000, "submissions a tenant may make at once "
                                    "before the rate applies", ge=1)
    fair_share: str = setting("GPUORCH_FAIR_SHARE", "", 'fair share over time as JSON: {"half_life_s": 604800, '
                              '"model_weights": {"h100": 2.0}, "weight": 1.0} (all optional; shares come from the '
                              'identity map)')
    preemption_margin_s: float = setting("GPUORCH_PREEMPTION_MARGIN_S", 60.0, "seconds past a victim's checkpoint "
                                         "grace before a silent preemption is requeued", ge=0)
    session_idle_park_s: float = setting("GPUORCH_SESSION_IDLE_PARK_S", 1800.0, "an interactive session with no "
                                         "proxied request and GPU utilisation below 1 % this long is parked (a "
                                         "session's own idle_park_after_s wins)", ge=10)
    session_idle_park_by_tenant: str = setting("GPUORCH_SESSION_IDLE_PARK_BY_TENANT", "", 'per-tenant default of '
                                               'GPUORCH_SESSION_IDLE_PARK_S: JSON {"<tenant>": seconds, "*": ...}')
    snapshot_every_events: int = setting("GPUORCH_SNAPSHOT_EVERY_EVENTS", 20000, "snapshot the state every N "
                                         "logged events", ge=1)
    snapshot_every_s: float = setting("GPUORCH_SNAPSHOT_EVERY_S", 300.0, "... or every T seconds when anything "
                                      "was logged", gt=0)
    mig_mode: Literal["off", "advise", "auto"] = setting(
        "GPUORCH_MIG_MODE", "advise", "MIG planner: off, advise (publish the plan as recommendations; the default) or "
        "auto (also drain GPUs and apply the layouts)")
    mig_plan_interval_s: float = setting("GPUORCH_MIG_PLAN_INTERVAL_S", 60.0, "seconds between MIG plans", gt=0)
    mig_min_pending_s: float = setting("GPUORCH_MIG_MIN_PENDING_S", 60.0, "MIG demand counts once it has waited "
                                       "this long (a burst is one decision)", ge=0)
    mig_min_interval_s: float = setting("GPUORCH_MIG_MIN_INTERVAL_S", 900.0, "hysteresis: seconds before a GPU is "
                                        "reconfigured again", ge=0)
    mig_max_per_hour: int = setting("GPUORCH_MIG_MAX_PER_HOUR", 2, "reconfigurations of one GPU per hour, at most",
                                    ge=1)
    mig_max_drain_jobs: int = setting("GPUORCH_MIG_MAX_DRAIN_JOBS", 2, "running jobs a reconfiguration may wait "
                                      "for on one GPU", ge=0)
    mig_pool_margin_slices: int = setting("GPUORCH_MIG_POOL_MARGIN_SLICES", 0, "warm pool: compute slices kept in "
                                          "MIG mode above the 95th percentile of the last 30 min of MIG demand",
                                          ge=0)
    mig_drain_wait_s: float = setting("GPUORCH_MIG_DRAIN_WAIT_S", 600.0, "seconds jobs on a draining GPU may end "
                                      "on their own before the preemptible ones are preempted (with their grace)",
                                      ge=0)
    mig_drain_give_up_s: float = setting("GPUORCH_MIG_DRAIN_GIVE_UP_S", 7200.0, "a drain still blocked by jobs "
                                         "that may not be preempted is abandoned after this long", gt=0)
    mig_apply_timeout_s: float = setting("GPUORCH_MIG_APPLY_TIMEOUT_S", 300.0, "no answer to ApplyMigLayout "
                                         "within this long: the GPU resumes with its old layout, and an alert", gt=0)
    step_journal: str = setting("GPUORCH_STEP_JOURNAL", "", "append every committed step's inputs to this file "
                                "(JSON lines; replay it through the Harness: gpuorch_scheduling.journal); empty: off")
    leader_lease_s: float = setting("GPUORCH_LEADER_LEASE_S", 5.0, "seconds a leader's lease lasts unrenewed: a "
                                    "paused or cut-off leader is replaced after about this long (the leader's AMQP "
                                    "heartbeat is a quarter of it)", ge=1, le=3600)
    leader_renew_s: float = setting("GPUORCH_LEADER_RENEW_S", 1.0, "seconds between lease renewals (and a "
                                    "standby's checks); below half the lease", gt=0)
    metrics_port: int = setting("GPUORCH_METRICS_PORT", 0, "port of /metrics, /healthz and /readyz (0 = off)",
                                ge=0, le=65535)

    _queues: QueuePolicy = PrivateAttr(default_factory=QueuePolicy)
    _identity_map: IdentityMap | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _derive(self) -> Settings:
        if self.leader_renew_s * 2 > self.leader_lease_s:
            raise ValueError("GPUORCH_LEADER_RENEW_S must be at most half of GPUORCH_LEADER_LEASE_S")
        try:
            parse_park_by_tenant(self.session_idle_park_by_tenant)
        except ValueError as exc:
            raise ValueError(f"GPUORCH_SESSION_IDLE_PARK_BY_TENANT: {exc}") from exc
        quotas_text = self.quotas
        if not quotas_text and self.quotas_file:
            try:
                quotas_text = Path(self.quotas_file).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"GPUORCH_QUOTAS_FILE: {exc}") from exc
        try:
            queues = QueuePolicy.from_json(quotas_text, self.ageing_points_per_minute)
        except ValueError as exc:
            raise ValueError(f"GPUORCH_QUOTAS: {exc}") from exc
        if self.identity_map_path:
            try:
                self._identity_map = load_identity_map(self.identity_map_path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"GPUORCH_IDENTITY_MAP: {exc}") from exc
        elif self.identity == "trust_all":
            self._identity_map = IdentityMap.development()
        else:
            raise ValueError("GPUORCH_IDENTITY_MAP is required (who may submit for which tenant); "
                             "GPUORCH_IDENTITY=trust_all only for local development")
        try:
            fair_share = FairSharePolicy.from_json(self.fair_share, dict(self._identity_map.shares))
        except ValueError as exc:
            raise ValueError(f"GPUORCH_FAIR_SHARE: {exc}") from exc
        self._queues = dataclasses.replace(
            queues, max_queued_per_tenant=self.max_queued_per_tenant, submissions_per_s=self.submissions_per_s,
            submission_burst=self.submission_burst, fair_share=fair_share)
        return self

    @property
    def queues(self) -> QueuePolicy:
        return self._queues

    @property
    def identity_map(self) -> IdentityMap:
        assert self._identity_map is not None
        return self._identity_map

    @property
    def trust_all(self) -> bool:
        return self.identity == "trust_all"

    @property
    def mig_control(self) -> MigControl:
        return MigControl(
            planner=PlannerSettings(mode=self.mig_mode, min_pending_s=self.mig_min_pending_s,
                                    min_interval_s=self.mig_min_interval_s, max_per_hour=self.mig_max_per_hour,
                                    max_drain_jobs=self.mig_max_drain_jobs,
                                    pool_margin_slices=self.mig_pool_margin_slices),
            execution=ExecutionSettings(drain_wait_s=self.mig_drain_wait_s, drain_give_up_s=self.mig_drain_give_up_s,
                                        apply_timeout_s=self.mig_apply_timeout_s),
            plan_interval_s=self.mig_plan_interval_s)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """How the scheduler decides, from these settings (a replay of this scheduler's journal uses the same)."""
        return SchedulerConfig(
            liveness=LivenessPolicy(suspect_after_s=self.suspect_after_s, lost_after_s=self.lost_after_s),
            queues=self.queues, preemption_margin_s=self.preemption_margin_s, retention_s=self.retention_s,
            identity=self.identity_map, trust_unidentified=self.trust_all, mig=self.mig_control,
            sessions=self.session_policy)

    @property
    def session_policy(self) -> SessionPolicy:
        """A session's tenant's idle-park time: the identity map's ``session_idle_park_s`` (the tenant, else its
        ``"*"``), else ``GPUORCH_SESSION_IDLE_PARK_BY_TENANT`` (the tenant, else its ``"*"``), else
        ``GPUORCH_SESSION_IDLE_PARK_S`` (a session's own ``idle_park_after_s`` wins over all)."""
        mapped = dict(self.identity_map.session_idle_park_s)
        if "*" in mapped:  # the map names every tenant: the settings' table is never reached
            return SessionPolicy(self.session_idle_park_s, mapped)
        return SessionPolicy(self.session_idle_park_s,
                             {**parse_park_by_tenant(self.session_idle_park_by_tenant), **mapped})

    @property
    def batch_wait_s(self) -> float:
        return self.batch_wait_ms / 1000.0

    @property
    def batch_budget_s(self) -> float:
        return self.batch_budget_ms / 1000.0
