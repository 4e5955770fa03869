"""Load users from deploy/rabbitmq/make_definitions.py into a test vhost through the management API.

``BrokerUsers(vhost, grants)`` creates each grant's user (password: the generator's development password), its
permissions and topic permissions; ``delete()`` removes the users again (users are global, not per vhost).
``install(installation)`` declares the topology as the setup step does (``gpuctl setup broker``), logged in as the
test vhost's administrator (guest): runtime users may not declare it themselves.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from gpuorch_messaging.queues import Installation, install

from conftest import AMQP_HOST, AMQP_MGMT, AMQP_PORT

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load_generator() -> Any:
    """deploy/rabbitmq/make_definitions.py as a module (it is a script, not a package)."""
    name = "gpuorch_deploy_make_definitions"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DEPLOY / "rabbitmq" / "make_definitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def management_api() -> httpx.Client:
    url = httpx.URL(AMQP_MGMT)
    return httpx.Client(base_url=f"{url.scheme}://{url.host}:{url.port}",
                        auth=(url.username or "guest", url.password or "guest"), timeout=30)


class BrokerUsers:
    def __init__(self, vhost: str, grants: Sequence[Any]) -> None:
        self.vhost = vhost
        self.grants = list(grants)
        self.api = management_api()

    def create(self) -> BrokerUsers:
        document = gen.definitions(self.grants, self.vhost)
        v = quote(self.vhost, safe="")
        try:
            for user in document["users"]:
                self.api.put(f"/api/users/{user['name']}", json={
                    "password": gen.dev_password(user["name"]), "tags": ",".join(user["tags"])}).raise_for_status()
            for p in document["permissions"]:
                body = {k: p[k] for k in ("configure", "write", "read")}
                self.api.put(f"/api/permissions/{v}/{p['user']}", json=body).raise_for_status()
            for t in document["topic_permissions"]:
                body = {k: t[k] for k in ("exchange", "write", "read")}
                self.api.put(f"/api/topic-permissions/{v}/{t['user']}", json=body).raise_for_status()
        except Exception:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        for grant in self.grants:
            self.api.delete(f"/api/users/{grant.user}")
        self.api.close()

    def url(self, user: str) -> str:
        return f"amqp://{user}:{gen.dev_password(user)}@{AMQP_HOST}:{AMQP_PORT}/{quote(self.vhost, safe='')}"

    @property
    def admin_url(self) -> str:
        """The test vhost's administrator (guest, every right): the setup identity of these tests."""
        return f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{quote(self.vhost, safe='')}"

    async def install(self, installation: Installation | None = None) -> list[str]:
        """Declare the exchanges and ``installation``'s queues (default: the scheduler's and telemetry's)."""
        return await install(self.admin_url, installation or Installation())


class RoleUsers(BrokerUsers):
    """Users named ``<role>-<random suffix>`` (globally unique), one per role, from role -> grant factory;
    ``url(role)`` connects as that role's user."""

    def __init__(self, vhost: str, factories: Mapping[str, Callable[[str], Any]]) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.names = {role: f"{role}-{suffix}" for role in factories}
        super().__init__(vhost, [factory(self.names[role]) for role, factory in factories.items()])

    def url(self, role: str) -> str:  # type: ignore[override]
        return super().url(self.names[role])

    @contextmanager
    def created(self) -> Iterator[RoleUsers]:
        """Create the users for the duration of the block, then delete them."""
        self.create()
        try:
            yield self
        finally:
            self.delete()
