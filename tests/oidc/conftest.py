"""Sign-in tests: a real OpenID provider (tests/oidc_provider: node's oidc-provider) for the session, and the API
as a process signing in through it for each module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.oidc_provider import NODE, NPM, Provider, api_with_sign_in, running_provider


@pytest.fixture(scope="session")
def oidc_provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    if NODE is None or NPM is None:
        pytest.skip("node and npm run the OpenID provider (apt-get install -y nodejs npm; .ci/run does)")
    with running_provider(tmp_path_factory.mktemp("oidc-provider")) as provider:
        yield provider


@pytest.fixture(scope="module")
def api_url(oidc_provider: Provider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with api_with_sign_in(tmp_path_factory.mktemp("api"), oidc_provider) as url:
        yield url
