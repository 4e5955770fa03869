"""The one dispatch idiom of every service: a handler registry.

A registry is a plain dict from a message type (the model's ``TYPE``, e.g. ``LaunchJob.TYPE``) to the function that
handles it, built in one place per service (``handlers(...)``, ``NodeExecutor.handlers``,
``TelemetryHandlers.handlers``, ``SchedulerService.fold_handlers``), so a reader finds any message's handler in one
hop. ``dispatch`` awaits the handler of a message; ``handler_for`` returns it (synchronous folds call it directly).
A message without a handler is not an error: it is logged (``dispatch.unhandled``) and returns None, and the
consumer acks it (queues bind only what their service handles; the allow-list refuses the rest before this).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from gpuorch_contracts import Message
from gpuorch_observability import get_logger

log = get_logger(__name__)

R = TypeVar("R")
Registry = Mapping[str, Callable[[Any], R]]
"""Message type -> handler."""


def handler_for(registry: Registry[R], message: Message, *, service: str) -> Callable[[Any], R] | None:
    """The handler ``registry`` names for ``message``'s type, or None (logged at debug level)."""
    handler = registry.get(message.TYPE)
    if handler is None:
        log.debug("dispatch.unhandled", service=service, type=message.TYPE)
    return handler


async def dispatch(registry: Registry[Awaitable[Any]], message: Message, *, service: str) -> Any:
    """Await the handler of ``message`` in ``registry``; None when it has none."""
    handler = handler_for(registry, message, service=service)
    return None if handler is None else await handler(message)
