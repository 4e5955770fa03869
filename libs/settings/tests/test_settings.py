"""Settings come from defaults, then a file, then the environment; bad values are named by their variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gpuorch_settings import ProgramSettings, ServiceSettings, SettingsError, setting
from pydantic import model_validator


class Example(ServiceSettings):
    amqp_url: str = setting("GPUORCH_AMQP_URL", "amqp://localhost/", "RabbitMQ URL")
    tick_s: float = setting("GPUORCH_TICK_S", 1.0, "seconds between ticks", gt=0)
    port: int = setting("GPUORCH_METRICS_PORT", 0, "metrics port", ge=0, le=65535)
    database_url: str = setting("GPUORCH_DATABASE_URL", description="PostgreSQL DSN")

    @model_validator(mode="after")
    def _port_is_not_the_amqp_port(self) -> Example:
        if self.port == 5672:
            raise ValueError("GPUORCH_METRICS_PORT must not be RabbitMQ's port")
        return self


def test_defaults_then_file_then_environment(tmp_path: Path) -> None:
    file = tmp_path / "gpuorch.toml"
    file.write_text('GPUORCH_TICK_S = 0.5\nport = 9100\nGPUORCH_DATABASE_URL = "postgresql://file/db"\n')
    settings = Example.load({"GPUORCH_METRICS_PORT": "9200", "GPUORCH_CONFIG_FILE": str(file)})
    assert (settings.tick_s, settings.port, settings.database_url) == (0.5, 9200, "postgresql://file/db")
    assert settings.amqp_url == "amqp://localhost/"
    json_file = tmp_path / "gpuorch.json"
    json_file.write_text('{"GPUORCH_DATABASE_URL": "postgresql://json/db"}')
    assert Example.load({}, json_file).database_url == "postgresql://json/db"


def test_every_problem_names_its_variable_and_value(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        Example.load({"GPUORCH_TICK_S": "-1", "GPUORCH_METRICS_PORT": "abc"})
    problems = caught.value.problems
    assert any(p.startswith("GPUORCH_TICK_S: Input should be greater than 0") and "'-1'" in p for p in problems)
    assert any(p.startswith("GPUORCH_METRICS_PORT: Input should be a valid integer") for p in problems)
    assert any(p.startswith("GPUORCH_DATABASE_URL: Field required") for p in problems)
    with pytest.raises(SettingsError, match="must not be RabbitMQ's port"):
        Example.load({"GPUORCH_DATABASE_URL": "x", "GPUORCH_METRICS_PORT": "5672"})
    typo = tmp_path / "typo.toml"
    typo.write_text("GPUORCH_TICKS = 2\n")
    with pytest.raises(SettingsError, match=r"unknown settings \['GPUORCH_TICKS'\]"):
        Example.load({"GPUORCH_DATABASE_URL": "x"}, typo)
    with pytest.raises(SettingsError, match="cannot read"):
        Example.load({"GPUORCH_DATABASE_URL": "x"}, tmp_path / "missing.toml")


def test_the_process_environment_is_read_when_no_mapping_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUORCH_DATABASE_URL", "postgresql://env/db")
    monkeypatch.setenv("GPUORCH_TICK_S", "3")
    settings = Example.load()
    assert (settings.database_url, settings.tick_s) == ("postgresql://env/db", 3.0)
    assert "GPUORCH_TICK_S" in Example.environment_help() and "(default: 1.0)" in Example.environment_help()


def test_a_service_exits_2_with_the_problems_on_invalid_settings() -> None:
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from test_settings import Example\n"
              "from gpuorch_settings import load_or_exit\n"
              "load_or_exit(Example, [], prog='example', description='an example', env={'GPUORCH_TICK_S': 'x'})\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid settings" in result.stderr and "GPUORCH_TICK_S: Input should be a valid number" in result.stderr
    assert "GPUORCH_DATABASE_URL: Field required" in result.stderr


def test_an_empty_variable_unsets_an_optional_setting_and_stays_empty_for_a_string() -> None:
    class Optional_(Example):
        endpoint: str | None = setting("GPUORCH_OTLP_ENDPOINT_X", "http://default", "an optional URL")

    settings = Optional_.load({"GPUORCH_DATABASE_URL": "x", "GPUORCH_OTLP_ENDPOINT": "", "GPUORCH_AMQP_URL": ""})
    assert settings.otlp_endpoint is None and settings.amqp_url == ""
    assert Optional_.load({"GPUORCH_DATABASE_URL": "x", "GPUORCH_OTLP_ENDPOINT_X": ""}).endpoint == ""


def test_a_program_without_a_settings_file_ignores_the_services_file(tmp_path: Path) -> None:
    class Client(ProgramSettings):
        file_variable = None

        server: str = setting("EXAMPLE_SERVER", "http://default", "the server")

    services_file = tmp_path / "scheduler.toml"
    services_file.write_text("GPUORCH_TICK_S = 0.5\n")  # unknown to Client: an error if it were read
    assert Client.load({"GPUORCH_CONFIG_FILE": str(services_file), "EXAMPLE_SERVER": "http://env"}).server == \
        "http://env"
    assert set(Client.model_fields) == {"server"}  # no log level, no collector: those are the services'
    assert Client.environment_help().splitlines()[0] == "environment variables:"
    assert Example.load({"GPUORCH_DATABASE_URL": "x", "GPUORCH_CONFIG_FILE": str(services_file)}).tick_s == 0.5
