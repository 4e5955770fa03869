"""gpuctl's one config idiom and one error idiom (settings.py, errors.py).

Settings: every environment variable gpuctl reads is a field of ``GpuctlSettings``, read from the process
environment, described in ``gpuctl --help``, and read per run (one run's options do not leak into the next).
Errors: a command that cannot do what was asked prints exactly one ``gpuctl: ...`` line on stderr, nothing on
stdout, and exits 1 (could not be done) or 2 (a wrong request); a bad option value is typer's usage error (2).
No server is needed: every address here is one where nothing listens (port 9).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpuorch_gpuctl.settings import GpuctlSettings
from gpuorch_gpuctl_ops.mig_cmd import mig_app
from typer.testing import CliRunner

from .conftest import Gpuctl

NOWHERE = "http://127.0.0.1:9"
"""An address where nothing listens: connecting is refused at once."""

READ = {
    "GPUCTL_CONFIG": ("config", "/somewhere/gpuctl.yaml", Path("/somewhere/gpuctl.yaml")),
    "GPUCTL_SERVER": ("server", "http://api.example:8080", "http://api.example:8080"),
    "GPUCTL_TOKEN": ("token", "t0ken", "t0ken"),
    "GPUORCH_OTLP_ENDPOINT": ("otlp_endpoint", "http://jaeger:4318", "http://jaeger:4318"),
    "GPUORCH_AMQP_ADMIN": ("amqp_admin", "http://rabbit:15672", "http://rabbit:15672"),
    "GPUORCH_DEMO_VHOST": ("demo_vhost", "demo-x", "demo-x"),
    "GPUORCH_DEMO_DATABASE_URL": ("demo_database_url", "postgresql://db/demo_x", "postgresql://db/demo_x"),
    "SUDO_USER": ("sudo_user", "alice", "alice"),
    "XDG_RUNTIME_DIR": ("xdg_runtime_dir", "/run/user/1000", "/run/user/1000"),
}
"""Each variable gpuctl reads: its field, a value set in the environment, the value the field must then hold."""


def test_the_settings_class_names_every_variable_gpuctl_reads() -> None:
    fields = {variable: name for variable, (name, _) in GpuctlSettings.variables().items()}
    assert fields == {variable: field for variable, (field, _, _) in READ.items()}
    assert all(meaning for _, meaning in GpuctlSettings.variables().values())


@pytest.mark.parametrize("variable", sorted(READ))
def test_each_variable_is_read_from_the_environment(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    field, value, expected = READ[variable]
    for other in READ:
        monkeypatch.delenv(other, raising=False)
    unset = GpuctlSettings.load()
    monkeypatch.setenv(variable, value)
    loaded = GpuctlSettings.load()
    assert getattr(loaded, field) == expected != getattr(unset, field)


def test_the_contexts_file_defaults_to_the_users_config_and_an_empty_variable_is_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCTL_CONFIG", "")
    monkeypatch.setenv("GPUCTL_SERVER", "")
    settings = GpuctlSettings.load()
    assert settings.config_path == Path.home() / ".config" / "gpuctl" / "config.yaml"
    assert settings.server is None


def test_a_services_settings_file_is_not_gpuctls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service_file = tmp_path / "scheduler.toml"
    service_file.write_text("GPUORCH_TICK_S = 0.5\n")  # a key gpuctl does not know: an error if gpuctl read it
    monkeypatch.setenv("GPUORCH_CONFIG_FILE", str(service_file))
    monkeypatch.setenv("GPUORCH_DEMO_VHOST", "from-the-environment")
    assert GpuctlSettings.load().demo_vhost == "from-the-environment"


def test_help_lists_every_variable_with_its_meaning(gpuctl: Gpuctl) -> None:
    gpuctl.env["COLUMNS"] = "400"  # one line per variable
    shown = gpuctl.ok("--help").stdout
    for variable, (_, meaning) in GpuctlSettings.variables().items():
        line = next((line for line in shown.splitlines() if f" {variable} " in line), "")
        assert meaning and meaning in line, f"{variable} in gpuctl --help"


def test_settings_and_options_belong_to_one_run(gpuctl: Gpuctl, tmp_path: Path) -> None:
    gpuctl.ok("config", "set-context", "here", "--server", NOWHERE)  # written to this test's GPUCTL_CONFIG
    assert "here" in (tmp_path / "gpuctl.yaml").read_text()
    gpuctl.env["GPUCTL_SERVER"] = "http://127.0.0.1:19"  # the variable wins over the contexts file
    assert "http://127.0.0.1:19" in gpuctl("jobs").stderr
    explicit = gpuctl("--server", "http://127.0.0.1:29", "jobs")  # ... and --server over the variable
    assert "http://127.0.0.1:29" in explicit.stderr
    del gpuctl.env["GPUCTL_SERVER"]
    after = gpuctl("jobs")  # the next run neither keeps the last one's --server nor its environment
    assert f"context here: {NOWHERE}" in after.stderr
    gpuctl("--server", "http://127.0.0.1:29", "jobs")
    alone = CliRunner().invoke(mig_app, ["plan"], env=gpuctl.env)  # a command group run on its own, just after
    assert f"context here: {NOWHERE}" in alone.stderr


ERRORS = [
    # (arguments, extra environment, exit code, what the one line says)
    (["jobs"], {}, 1, "no gpuorch API configured"),
    (["--server", NOWHERE, "nodes", "--json"], {}, 1, f"cannot reach the gpuorch API at {NOWHERE}"),
    (["events"], {"GPUCTL_SERVER": NOWHERE}, 1, "cannot reach the gpuorch API"),  # lists recent ones
    (["--server", NOWHERE, "submit", "--gpu-milli", "5000", "--", "true"], {}, 2, "invalid job"),
    (["config", "use-context", "nope"], {}, 1, "no context 'nope'"),
    (["describe", "abc", "--dsn", "postgresql://postgres@127.0.0.1:9/x"], {}, 1, "cannot reach the database"),
    (["jobs", "-w", "--dsn", "postgresql://postgres@127.0.0.1:9/x"], {}, 2, "-w needs the API"),
    (["down", "--json"], {}, 1, "no running demo stack recorded"),
]


@pytest.mark.parametrize(("args", "env", "code", "says"), ERRORS, ids=[" ".join(e[0][:3]) for e in ERRORS])
def test_a_command_that_cannot_do_it_says_so_in_one_line(gpuctl: Gpuctl, tmp_path: Path, args: list[str],
                                                         env: dict[str, str], code: int, says: str) -> None:
    gpuctl.env.update(env)
    if args[0] == "down":
        args = [*args, "--root", str(tmp_path)]
    done = gpuctl(*args)
    assert (done.exit_code, done.stdout) == (code, ""), done.output
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("gpuctl: ") and says in done.stderr, \
        done.stderr


def test_an_unreadable_config_file_is_a_wrong_request(gpuctl: Gpuctl, tmp_path: Path) -> None:
    (tmp_path / "gpuctl.yaml").write_text("contexts: [1\n")
    done = gpuctl("jobs")
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("gpuctl: cannot read ")


def test_a_bad_option_value_is_typers_usage_error(gpuctl: Gpuctl, tmp_path: Path) -> None:
    done = gpuctl("--server", NOWHERE, "submit", "-f", str(tmp_path / "absent.yaml"))
    assert done.exit_code == 2 and "Invalid value for --file" in done.stderr and "gpuctl:" not in done.stderr


def test_the_script_fails_in_one_line_where_a_setting_points_nowhere(tmp_path: Path) -> None:
    """``gpuctl up`` as a process, with the management API (GPUORCH_AMQP_ADMIN) where nothing listens: one line
    naming that address, exit 1, no traceback; nothing was started, so nothing is recorded."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")},
           "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml"), "GPUORCH_AMQP_ADMIN": NOWHERE}
    done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "up", "--unsandboxed", "--json", "--root",
                           str(tmp_path / "up")], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(
        f"gpuctl: the RabbitMQ management API at {NOWHERE} did not create"), done.stderr
    assert not (tmp_path / "up" / "stack.json").exists() and not (tmp_path / "gpuctl.yaml").exists()
