"""A real OpenID provider for the sign-in tests: panva's oidc-provider (provider.mjs) run by node.

    install()                       npm ci once per lock file (a file lock: pytest-xdist workers share it)
    running_provider(dir)           the provider process on a free port, signing with keys the test holds
    sign(provider, claims, ...)     a JWT signed with the provider's own key (or another): forged expiries,
                                    audiences and issuers the API must refuse
    approve_device(...)             a person approving a device code on the provider's pages (httpx)
    sign_in_with_pkce(...)          a browserless authorization code + PKCE sign-in (httpx): an ID token

    oidc_provider, oidc_api_url     pytest fixtures: the provider for the session, the API signing in through it for
                                    a module (import them into a conftest or a test module)
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlparse

import httpx
import pytest

HERE = Path(__file__).parent
CLIENT_ID = "gpuorch"
NODE = shutil.which("node")
NPM = shutil.which("npm")
GROUPS = {"alice": ["acme-devs"], "olga": ["staff", "gpuorch-operators"], "mallory": ["contractors"]}
"""The provider's accounts (provider.mjs) and their groups claim."""


def install() -> None:
    """``npm ci`` in this directory unless node_modules already holds the oidc-provider version the lock file pins
    (.ci/run installs it up front; a file lock keeps pytest-xdist workers from installing side by side)."""
    if NODE is None or NPM is None:
        raise RuntimeError("node and npm are needed for the OpenID provider (apt-get install -y nodejs npm)")
    with open(HERE / ".npm-ci.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if _installed():
            return
        subprocess.run([NPM, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--silent"], cwd=HERE, check=True,
                       timeout=300)


def _installed() -> bool:
    pinned = json.loads((HERE / "package-lock.json").read_text())["packages"]["node_modules/oidc-provider"]["version"]
    try:
        return bool(json.loads((HERE / "node_modules/oidc-provider/package.json").read_text())["version"] == pinned)
    except (OSError, ValueError, KeyError):
        return False


@dataclass
class Provider:
    """A running provider: its issuer URL, the client id and the private signing key (a JWK) it uses."""

    issuer: str
    client_id: str
    key: dict[str, Any]
    process: subprocess.Popen[str] = field(repr=False)

    @property
    def kid(self) -> str:
        return str(self.key["kid"])


def new_key(kid: str) -> dict[str, Any]:
    """A fresh RSA signing key as a private JWK."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    from jwt.algorithms import RSAAlgorithm

    jwk = json.loads(RSAAlgorithm.to_jwk(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    jwk.pop("key_ops", None)  # PyJWT writes ["sign"]: the provider would not verify with it (id_token_hint)
    return {**jwk, "kid": kid, "alg": "RS256", "use": "sig"}


@contextmanager
def running_provider(directory: Path, *, id_token_ttl_s: int = 600, keys: list[dict[str, Any]] | None = None,
                     port: int = 0) -> Iterator[Provider]:
    """The provider on 127.0.0.1 (``port`` 0: a free one) until the block ends, signing with the first of ``keys``
    (default: a new key) and publishing them all."""
    install()
    keys = keys or [new_key(f"test-{secrets.token_hex(4)}")]
    key = keys[0]
    jwks = directory / "jwks.json"
    jwks.write_text(json.dumps({"keys": keys}))
    assert NODE is not None
    env = {**os.environ, "OIDC_JWKS": str(jwks), "OIDC_CLIENT_ID": CLIENT_ID, "OIDC_PORT": str(port),
           "OIDC_ID_TOKEN_TTL": str(id_token_ttl_s)}
    log = open(directory / "provider.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen([NODE, str(HERE / "provider.mjs")], env=env, stdout=subprocess.PIPE, stderr=log,
                               text=True)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # blocks until the provider serves (or exits: "")
        if not first:
            raise RuntimeError(f"the OpenID provider did not start: {(directory / 'provider.log').read_text()}")
        yield Provider(json.loads(first)["issuer"], CLIENT_ID, key, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def sign(claims: dict[str, Any], key: dict[str, Any], *, algorithm: str = "RS256",
         headers: dict[str, Any] | None = None) -> str:
    """``claims`` as a JWT signed with the private JWK ``key`` (its kid in the header)."""
    import jwt

    return jwt.encode(claims, jwt.PyJWK(key).key, algorithm=algorithm, headers={"kid": key["kid"], **(headers or {})})


def unsigned(claims: dict[str, Any], kid: str) -> str:
    """``claims`` as an unsecured JWT (alg none, no signature): what an attacker sends when a verifier trusts alg."""
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT', 'kid': kid})}.{part(claims)}."


def claims_for(provider: Provider, user: str, **overrides: Any) -> dict[str, Any]:
    """The claims the provider puts in ``user``'s ID token, valid for ten minutes, with ``overrides``."""
    now = int(time.time())
    return {"iss": provider.issuer, "aud": provider.client_id, "sub": user, "preferred_username": user,
            "groups": GROUPS.get(user, []), "iat": now, "exp": now + 600, **overrides}


class _Forms(HTMLParser):
    """The forms of a page: action, method and the values of their inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "form":
            self.forms.append({"action": named.get("action") or "", "method": (named.get("method") or "get").lower(),
                               "id": named.get("id"), "fields": {}})
        elif tag == "input" and self.forms and named.get("name"):  # buttons count only when clicked: none here
            self.forms[-1]["fields"][str(named["name"])] = named.get("value") or ""


def submit_form(client: httpx.Client, page: httpx.Response, fields: dict[str, str] | None = None) -> httpx.Response:
    """Submit the first form of ``page`` with its own values and ``fields`` over them, following redirects."""
    parser = _Forms()
    parser.feed(page.text)
    assert parser.forms, f"no form on {page.url}: {page.text[:500]}"
    form = parser.forms[0]
    action = urljoin(str(page.url), form["action"] or str(page.url))
    data = {**form["fields"], **(fields or {})}
    if form["method"] == "post":
        return client.post(action, data=data, follow_redirects=True)
    return client.get(action, params=data, follow_redirects=True)


def through_provider(client: httpx.Client, response: httpx.Response, user: str,
                     stop_at: str | None = None) -> httpx.Response | str:
    """Follow the provider's redirects and pages as ``user`` would: the login form (devInteractions: any password),
    then the consent form. Returns the first redirect to ``stop_at`` (the client's redirect URI, where nothing may
    listen) as a URL, else the page where no provider form is left."""
    for _ in range(20):
        if response.is_redirect:
            location = urljoin(str(response.url), response.headers["location"])
            if stop_at is not None and location.startswith(stop_at):
                return location
            response = client.get(location)
            continue
        parser = _Forms()
        parser.feed(response.text)
        prompt = parser.forms[0]["fields"].get("prompt") if parser.forms else None
        if prompt not in ("login", "consent"):
            return response
        form = parser.forms[0]
        fields = {"login": user, "password": "any"} if prompt == "login" else {}
        response = client.post(urljoin(str(response.url), form["action"]), data={**form["fields"], **fields})
    raise AssertionError(f"still on the provider's pages at {response.url}")


def approve_device(provider: Provider, user_code: str, user: str) -> None:
    """A person on the provider's pages: enters ``user_code``, confirms the device, signs in as ``user``."""
    with httpx.Client(timeout=30) as client:
        page = client.get(f"{provider.issuer}/device", follow_redirects=True)
        page = submit_form(client, page, {"user_code": user_code})   # the code
        page = submit_form(client, page)                              # "Continue": this is my device
        page = through_provider(client, page, user)
        assert isinstance(page, httpx.Response) and page.status_code == 200 and "Sign-in Success" in page.text, re.sub(r"\s+", " ", page.text)[-1500:]


def sign_in_with_pkce(provider: Provider, user: str, redirect_uri: str = "http://127.0.0.1:9/") -> dict[str, Any]:
    """The authorization code flow with PKCE, as the dashboard runs it, without a browser: the token response."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    state = secrets.token_urlsafe(16)
    with httpx.Client(timeout=30) as client:
        page = client.get(f"{provider.issuer}/auth", params={
            "client_id": provider.client_id, "response_type": "code", "scope": "openid profile email groups",
            "redirect_uri": redirect_uri, "state": state, "code_challenge": challenge,
            "code_challenge_method": "S256"})
        callback = through_provider(client, page, user, stop_at=redirect_uri)
        assert isinstance(callback, str), f"no redirect to {redirect_uri}: {callback.text[:500]}"
        query = parse_qs(urlparse(callback).query)
        assert query.get("state") == [state], callback
        token = client.post(f"{provider.issuer}/token", data={
            "grant_type": "authorization_code", "code": query["code"][0], "redirect_uri": redirect_uri,
            "client_id": provider.client_id, "code_verifier": verifier})
        token.raise_for_status()
        answer: dict[str, Any] = token.json()
        return answer


STATIC_TOKEN = "ops-machine-secret"
"""A static API token of ``sign_in_identity_map`` (identity ops): machines keep using tokens next to sign-in."""


def sign_in_identity_map(provider: Provider, **oidc: Any) -> dict[str, Any]:
    """Two identities reached by the provider's groups (operators first), one static token, and the provider
    (``oidc``: more settings of its section)."""
    return {
        "identities": {
            "*": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
            "acme-team": {"role": "submitter", "tenants": ["acme"], "default_tenant": "acme"},
            "ops": {"role": "operator", "tenants": ["*"], "default_tenant": "default", "max_priority": "critical"},
        },
        "tokens": {hashlib.sha256(STATIC_TOKEN.encode()).hexdigest(): "ops"},
        "oidc": {"issuer": provider.issuer, "client_id": provider.client_id, "provider_name": "Test IdP",
                 "groups": [{"group": "gpuorch-operators", "identity": "ops"},
                            {"group": "acme-devs", "identity": "acme-team"}], **oidc},
    }


@contextmanager
def api_with_sign_in(root: Path, provider: Provider, **oidc: Any) -> Iterator[str]:
    """The API as a process (no other service) on a fresh vhost and database, signing in through ``provider``
    (``oidc``: more settings of the map's oidc section); yields its URL once ready."""
    import asyncio

    from gpuorch_gpuctl_ops.stack import LocalStack
    from gpuorch_messaging import Broker

    from conftest import AMQP_HOST, AMQP_PORT, PG_ADMIN, drop_database, drop_vhost, make_database, make_vhost

    async def declare_exchanges(url: str) -> None:  # as the scheduler would: the API looks them up
        broker = Broker(url, producer="test")
        await broker.connect()
        await broker.close()

    vhost, database = make_vhost(), make_database()
    amqp_url = f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{vhost}"
    stack = LocalStack(root=root, amqp_url=amqp_url, database_url=f"{PG_ADMIN.rsplit('/', 1)[0]}/{database}",
                       nodes=[], identity_map=sign_in_identity_map(provider, **oidc))
    try:
        asyncio.run(declare_exchanges(amqp_url))
        yield stack.start_api()
    except Exception:
        print(f"--- api ---\n{stack.tail('api', 40)}" if "api" in stack.processes else "")
        raise
    finally:
        stack.stop_all()
        drop_vhost(vhost)
        drop_database(database)


@pytest.fixture(scope="session")
def oidc_provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    if NODE is None or NPM is None:
        pytest.skip("node and npm run the OpenID provider (apt-get install -y nodejs npm; .ci/run does)")
    with running_provider(tmp_path_factory.mktemp("oidc-provider")) as provider:
        yield provider


@pytest.fixture(scope="module")
def oidc_api_url(oidc_provider: Provider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with api_with_sign_in(tmp_path_factory.mktemp("api"), oidc_provider) as url:
        yield url
