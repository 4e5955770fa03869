"""The scheduler's settings: environment over file over defaults; quotas and the identity map validated at load."""

from __future__ import annotations

from pathlib import Path

import pytest
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
