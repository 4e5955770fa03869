"""``gpuctl login`` and ``gpuctl logout``: single sign-on with the team's OpenID provider, for a person at a
terminal, by the device authorization grant (RFC 8628).

    gpuctl login [--server URL] [--context NAME]
        GET {server}/api/v1/auth/config             the provider's device and token endpoints, the CLI's client id
        POST device_authorization_endpoint          -> device_code, user_code, verification_uri(_complete), interval
        print the URL and the code (stderr)         the person approves in any browser, on any machine
        POST token_endpoint (grant device_code)     every ``interval`` s: authorization_pending / slow_down (+5 s)
                                                    until an ID token, access_denied or expired_token
        the context gets: token (the ID token: the API's bearer), refresh_token, token_expires_at (the ID token's
        exp), oidc {token_endpoint, revocation_endpoint, client_id}; the file stays mode 0600 (contexts.py)
    any later command: contexts.context_endpoint -> ``refreshed`` swaps an expired (or about to expire) token for a
        new one with the refresh token, before the request (no refresh token, or refused: "run gpuctl login")
    gpuctl logout [--context NAME]: revokes the refresh token where the provider offers revocation, and removes
        token, refresh token and provider details from the context (its server stays)

The ID token's ``exp`` is read without verifying its signature: only to know when to refresh; the API verifies
every token it is sent (gpuorch_api.oidc). httpx only: this module is part of the thin client.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from gpuorch_gpuctl.contexts import load_config, save_config
from gpuorch_gpuctl.errors import USAGE, fail
from gpuorch_gpuctl.settings import this_run

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
REFRESH_AHEAD_S = 30.0
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
ContextOpt = Annotated[str | None, typer.Option("--context", help="the context to sign in (default: the current "
                                                "one; with --server: created as 'default' when none is named)")]


def login(
    server: Annotated[str | None, typer.Option("--server", help="API base URL (default: the context's server)")] = None,
    context: ContextOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Sign in with the team's OpenID provider (device flow: open the URL shown, enter the code)."""
    path = this_run().settings.config_path
    document = load_config(path)
    name = context or document.get("current-context") or "default"
    entry = dict(document["contexts"].get(name) or {})
    server = (server or this_run().server or entry.get("server") or "").rstrip("/")
    if not server:
        fail(f"no server for context {name!r}: gpuctl login --server URL", USAGE)
    provider = _sign_in_config(server)
    with httpx.Client(timeout=TIMEOUT) as http:
        grant = _post(http, provider["device_authorization_endpoint"],
                      {"client_id": provider["cli_client_id"], "scope": " ".join(provider["scopes"])})
        url = grant.get("verification_uri_complete") or grant["verification_uri"]
        print(f"To sign in, open {url}\nand enter the code {grant['user_code']} (it expires in "
              f"{int(grant.get('expires_in', 600)) // 60} min). Waiting...", file=sys.stderr, flush=True)
        tokens = _poll(http, provider, grant)
    entry.update(server=server, **_stored(tokens, provider))
    document["contexts"][name] = entry
    if context is None or not document.get("current-context"):
        document["current-context"] = name
    save_config(document, path)
    me = _whoami(server, entry["token"])
    result = {"context": name, "server": server, "identity": me.get("identity"), "user": me.get("user"),
              "role": me.get("role"), "tenants": me.get("tenants"), "expires_at": entry["token_expires_at"]}
    if as_json:
        print(json.dumps(result))
    else:
        print(f"signed in as {result['user']} (identity {result['identity']}, {result['role']} of "
              f"{', '.join(result['tenants'] or [])}) on context {name}")


def logout(context: ContextOpt = None, as_json: JsonOpt = False) -> None:
    """Sign out: forget this context's token (and revoke its refresh token at the provider)."""
    path = this_run().settings.config_path
    document = load_config(path)
    name = context or document.get("current-context")
    entry: Any = document["contexts"].get(name) if name else None
    if not isinstance(entry, dict):
        fail(f"no context {name!r} in {path} (gpuctl config get-contexts)")
    revoked = False
    oidc = entry.get("oidc") or {}
    if entry.get("refresh_token") and oidc.get("revocation_endpoint"):
        try:
            revoked = httpx.post(oidc["revocation_endpoint"], timeout=TIMEOUT, data={
                "token": entry["refresh_token"], "token_type_hint": "refresh_token",
                "client_id": oidc.get("client_id", "")}).status_code == 200
        except httpx.HTTPError:
            revoked = False  # signed out here all the same; the provider's session ends with its lifetime
    for key in ("token", "refresh_token", "token_expires_at", "oidc"):
        entry.pop(key, None)
    save_config(document, path)
    if as_json:
        print(json.dumps({"context": name, "signed_out": True, "refresh_token_revoked": revoked}))
    else:
        print(f"signed out of context {name}" + (" (refresh token revoked)" if revoked else ""))


def refreshed(entry: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    """``entry`` (a context) with a fresh token when its signed-in token has expired or is about to and it holds a
    refresh token; saved to ``path``. A context without a sign-in (a static token) is returned as it is."""
    expires_at = entry.get("token_expires_at")
    oidc: Any = entry.get("oidc")
    if not isinstance(expires_at, int | float) or time.time() < expires_at - REFRESH_AHEAD_S:
        return entry
    if not entry.get("refresh_token") or not isinstance(oidc, dict):
        fail(f"the sign-in of context {name} expired: gpuctl login --context {name}")
    with httpx.Client(timeout=TIMEOUT) as http:
        try:
            response = http.post(oidc["token_endpoint"], data={
                "grant_type": "refresh_token", "refresh_token": entry["refresh_token"], "client_id": oidc["client_id"]})
        except httpx.HTTPError as exc:
            fail(f"cannot refresh the sign-in of context {name} at {oidc['token_endpoint']}: {exc}")
    if response.status_code != 200 or "id_token" not in _json(response):
        fail(f"the sign-in of context {name} expired and could not be refreshed ({_error(response)}): "
             f"gpuctl login --context {name}")
    updated = {**entry, **_stored(_json(response), oidc, refresh_token=entry["refresh_token"])}
    document = load_config(path)
    document["contexts"][name] = updated
    save_config(document, path)
    return updated


def _sign_in_config(server: str) -> dict[str, Any]:
    try:
        response = httpx.get(f"{server}/api/v1/auth/config", timeout=TIMEOUT)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the gpuorch API at {server}: {exc}")
    if response.status_code != 200:
        fail(f"{server}/api/v1/auth/config: {_error(response)}")
    provider: Any = _json(response).get("oidc")
    if not provider:
        fail(f"{server} has no single sign-on configured: use an API token "
             "(gpuctl config set-context NAME --server URL --token TOKEN)")
    if not provider.get("device_authorization_endpoint"):
        fail(f"the provider {provider.get('issuer')} offers no device authorization endpoint (RFC 8628): "
             "use an API token")
    return dict(provider)


def _poll(http: httpx.Client, provider: dict[str, Any], grant: dict[str, Any]) -> dict[str, Any]:
    """The token response once the person approved; fails on denial or expiry (RFC 8628 section 3.5)."""
    interval = float(grant.get("interval") or 5)
    deadline = time.monotonic() + float(grant.get("expires_in") or 600)
    while True:
        if time.monotonic() >= deadline:
            fail("the code expired before it was entered: gpuctl login again")
        time.sleep(interval)
        response = _post(http, provider["token_endpoint"], {
            "grant_type": DEVICE_GRANT, "device_code": grant["device_code"], "client_id": provider["cli_client_id"]},
            check=False)
        error = response.get("error")
        if error is None:
            if "id_token" not in response:
                fail("the provider answered without an ID token: is 'openid' among the scopes?")
            return response
        if error == "authorization_pending":
            continue
        if error == "slow_down":
            interval += 5
            continue
        fail({"access_denied": "the sign-in was refused at the provider",
              "expired_token": "the code expired before it was entered: gpuctl login again"}.get(
                  error, f"sign-in failed: {error} {response.get('error_description', '')}".strip()))


def _stored(tokens: dict[str, Any], provider: dict[str, Any], refresh_token: str | None = None) -> dict[str, Any]:
    """What a context keeps of a token response."""
    stored: dict[str, Any] = {
        "token": tokens["id_token"], "token_expires_at": _expiry(tokens["id_token"]),
        "oidc": {"token_endpoint": provider["token_endpoint"], "client_id": provider.get("cli_client_id")
                 or provider.get("client_id"), "revocation_endpoint": provider.get("revocation_endpoint")}}
    if tokens.get("refresh_token") or refresh_token:
        stored["refresh_token"] = tokens.get("refresh_token") or refresh_token
    return stored


def _expiry(id_token: str) -> int:
    """The ``exp`` claim of a JWT, read without verifying it (the API verifies): when to refresh."""
    expiry: int | None = None
    try:
        payload = id_token.split(".")[1]
        expiry = int(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["exp"])
    except (IndexError, ValueError, KeyError, TypeError):
        fail("the provider's ID token is not a JWT with an exp claim")
    assert expiry is not None
    return expiry


def _whoami(server: str, token: str) -> dict[str, Any]:
    try:
        response = httpx.get(f"{server}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"},
                             timeout=TIMEOUT)
    except httpx.HTTPError as exc:
        fail(f"signed in, but the API at {server} is unreachable: {exc}")
    if response.status_code != 200:
        fail(f"signed in at the provider, but the API refuses the token: {_error(response)}")
    return dict(_json(response))


def _post(http: httpx.Client, url: str, data: dict[str, str], *, check: bool = True) -> dict[str, Any]:
    try:
        response = http.post(url, data=data)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the OpenID provider at {url}: {exc}")
    if check and response.status_code != 200:
        fail(f"{url}: {_error(response)}")
    return _json(response)


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _error(response: httpx.Response) -> str:
    body = _json(response)
    return str(body.get("detail") or body.get("error_description") or body.get("error")
               or f"HTTP {response.status_code}")
