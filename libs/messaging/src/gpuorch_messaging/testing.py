"""In-memory fakes for unit tests of pure handler logic (integration tests use the real broker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuorch_contracts import Message, route


class RecordingPublisher:
    """A ``Publisher`` that records what was published, in order, with its route."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str, Message]] = []

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        exchange, key = route(message)
        self.published.append((exchange, key, message))

    def of_type(self, cls: type[Message]) -> list[Any]:
        return [m for _, _, m in self.published if isinstance(m, cls)]
