"""The scheduler's settings: environment over file over defaults; quotas and the identity map validated at load."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpuorch_contracts import JobSpec, ProcessRun, SessionSpec
from gpuorch_scheduler.settings import Settings
from gpuorch_settings import SettingsError


def test_quotas_identity_and_batching_come_from_the_environment_or_a_file(tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_text('{"team-a": {"gpus": 8}}')
    config = tmp_path / "scheduler.toml"
    config.write_text(f'GPUORCH_QUOTAS_FILE = "{quotas}"\nGPUORCH_BATCH_WAIT_MS = 50\nGPUORCH_TICK_S = 2\n')
    settings = Settings.load({"GPUORCH_IDENTITY": "trust_all", "GPUORCH_TICK_S": "0.5",
                              "GPUORCH_MAX_QUEUED_PER_TENANT": "7"}, config)
    assert settings.queues.quotas["team-a"].gpus == 8 and settings.queues.max_queued_per_tenant == 7
    assert settings.tick_s == 0.5 and settings.batch_wait_s == 0.05 and settings.trust_all
    assert settings.identity_map.identities["*"].role == "operator"


def test_invalid_settings_are_named() -> None:
    with pytest.raises(SettingsError, match="GPUORCH_IDENTITY_MAP is required"):
        Settings.load({})
    with pytest.raises(SettingsError, match="GPUORCH_QUOTAS: "):
        Settings.load({"GPUORCH_IDENTITY": "trust_all", "GPUORCH_QUOTAS": "[1]"})
    with pytest.raises(SettingsError, match="GPUORCH_IDENTITY_MAP: "):
        Settings.load({"GPUORCH_IDENTITY_MAP": "/nonexistent/identity.json"})
    with pytest.raises(SettingsError, match="GPUORCH_LOST_AFTER_S: Input should be greater than 0"):
        Settings.load({"GPUORCH_IDENTITY": "trust_all", "GPUORCH_LOST_AFTER_S": "0"})


def _park_after(settings: Settings, tenant: str, own: float | None = None) -> float:
    spec = JobSpec(run=ProcessRun(argv=["sleep", "1"]), tier="interactive", tenant=tenant,
                   session=SessionSpec(idle_park_after_s=own))
    return settings.session_policy.park_after(SimpleNamespace(spec=spec))  # type: ignore[arg-type]


def test_a_tenants_idle_park_time_comes_from_the_identity_map_then_the_settings(tmp_path: Path) -> None:
    identity = tmp_path / "identity.json"
    env = {"GPUORCH_IDENTITY_MAP": str(identity), "GPUORCH_SESSION_IDLE_PARK_S": "1200",
           "GPUORCH_SESSION_IDLE_PARK_BY_TENANT": '{"research": 600, "lab": 300, "*": 900}'}
    identity.write_text(json.dumps({"identities": {"alice": {"role": "submitter", "tenants": ["research"]}},
                                    "session_idle_park_s": {"research": 60}}))
    settings = Settings.load(env)
    assert [_park_after(settings, t) for t in ("research", "lab", "other")] == [60, 300, 900]
    assert _park_after(settings, "research", own=20) == 20  # the session's own wins
    identity.write_text(json.dumps({"identities": {}, "session_idle_park_s": {"research": 60, "*": 120}}))
    settings = Settings.load(env)  # the map names every tenant: the settings' table is not reached
    assert [_park_after(settings, t) for t in ("research", "lab", "other")] == [60, 120, 120]
    identity.write_text(json.dumps({"identities": {}}))
    assert _park_after(Settings.load({**env, "GPUORCH_SESSION_IDLE_PARK_BY_TENANT": ""}), "lab") == 1200
    identity.write_text(json.dumps({"identities": {}, "session_idle_park_s": {"lab": 5}}))
    with pytest.raises(SettingsError, match="GPUORCH_IDENTITY_MAP: "):
        Settings.load(env)


def test_the_core_bench_times_the_step_under_the_services_collector_thresholds() -> None:
    """``gpuctl bench core`` keeps a copy of the thresholds (gpuctl imports no service package): the same values."""
    from gpuorch_gpuctl_ops.bench_core import SERVICE_GC_THRESHOLD
    from gpuorch_scheduler.relay import GC_THRESHOLD

    assert SERVICE_GC_THRESHOLD == GC_THRESHOLD
