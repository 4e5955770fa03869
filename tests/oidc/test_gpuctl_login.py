"""``gpuctl login`` against the real provider: the device flow end to end (the test is the person who approves the
code on the provider's pages), the token and refresh token kept in the context, an expired sign-in refreshed
before the next command, and ``gpuctl logout`` forgetting it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.oidc_provider import Provider, approve_device

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def gpuctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], capture_output=True, text=True,
                          env=_env(config), timeout=60)


def _env(config: Path) -> dict[str, str]:
    drop = {"GPUCTL_TOKEN", "GPUCTL_SERVER", "GPUORCH_DATABASE_URL", "GPUORCH_AMQP_URL"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "GPUCTL_CONFIG": str(config)}


def test_gpuctl_login_by_device_flow_refresh_and_logout(oidc_api_url: str, oidc_provider: Provider,
                                                        tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    login = subprocess.Popen([sys.executable, "-m", "gpuorch_gpuctl", "login", "--server", oidc_api_url, "--context",
                              "sso", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(config))
    try:
        assert login.stderr is not None
        prompt = login.stderr.readline() + login.stderr.readline()  # "To sign in, open URL\nand enter the code C"
        url = re.search(r"open (\S+)", prompt)
        code = re.search(r"enter the code (\S+)", prompt)
        assert url and code, prompt
        assert url.group(1).startswith(f"{oidc_provider.issuer}/device")
        approve_device(oidc_provider, code.group(1), "alice")
        out, err = login.communicate(timeout=60)
    finally:
        login.kill()
    assert login.returncode == 0, err
    signed_in = json.loads(out)
    assert signed_in | {"expires_at": 0} == {"context": "sso", "server": oidc_api_url, "identity": "acme-team",
                                             "user": "alice", "role": "submitter", "tenants": ["acme"],
                                             "expires_at": 0}
    document = yaml.safe_load(config.read_text())
    entry = document["contexts"]["sso"]
    assert document["current-context"] == "sso" and entry["refresh_token"] and entry["token"].count(".") == 2
    assert config.stat().st_mode & 0o777 == 0o600

    me = gpuctl(config, "whoami", "--json")
    assert me.returncode == 0, me.stderr
    assert json.loads(me.stdout)["identity"] == "acme-team"

    # the sign-in expired: the next command swaps it for a new one with the refresh token, and goes on
    first = entry["token"]
    entry["token_expires_at"] = 0
    config.write_text(yaml.safe_dump(document))
    me = gpuctl(config, "whoami", "--json")
    assert me.returncode == 0, me.stderr
    assert json.loads(me.stdout)["user"] == "alice"
    renewed = yaml.safe_load(config.read_text())["contexts"]["sso"]
    assert renewed["token"] != first and renewed["token_expires_at"] > 0

    out = gpuctl(config, "logout", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"context": "sso", "signed_out": True, "refresh_token_revoked": True}
    left = yaml.safe_load(config.read_text())["contexts"]["sso"]
    assert left == {"server": oidc_api_url}
    refused = gpuctl(config, "whoami")
    assert refused.returncode == 1 and "set a token" in refused.stderr, refused.stderr


def test_gpuctl_login_reports_an_unreachable_api_in_one_line(tmp_path: Path) -> None:
    out = gpuctl(tmp_path / "config.yaml", "login", "--server", "http://127.0.0.1:9")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "cannot reach" in out.stderr, out.stderr
