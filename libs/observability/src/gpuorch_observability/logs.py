"""structlog JSON logging with trace correlation."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def _add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write, not at configure time: a process that swaps
    it (a CLI test runner capturing output, then closing its buffer) keeps logging instead of raising
    ``I/O operation on closed file`` in whatever logs next."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, level: str = "INFO") -> None:
    """JSON lines on stderr: timestamp, level, service, event, trace_id/span_id, bound context vars."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


def bind_context(**values: Any) -> Any:
    """Bind ``job_id``/``node_id``... to every log line of the current task; returns tokens for reset."""
    return structlog.contextvars.bound_contextvars(**{k: str(v) for k, v in values.items() if v is not None})
