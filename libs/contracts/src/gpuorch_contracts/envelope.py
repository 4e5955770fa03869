"""The message envelope every gpuorch message carries, and bounded field types.

Contract:
- every message is a pydantic model with ``extra="forbid"``: an unknown field is a validation error, never ignored;
- ``message_id`` is the idempotency key: a consumer that sees the same id twice applies it once;
- ``type`` names the message (``job.submit``, ``job.placed`` ...) and selects the model on decode;
- ``schema_version`` starts at 1; a breaking change is a new version handled side by side, compatible changes only
  add optional fields;
- ``occurred_at`` is timezone-aware UTC; ``producer`` names the emitting service instance;
- every string is one of the types of ``gpuorch_contracts.text`` (no control characters, NUL included; identifiers
  match a safe pattern), every number is bounded and every float finite.
The W3C ``traceparent`` travels in AMQP headers, not in the body (see gpuorch_messaging).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from gpuorch_contracts.text import Arg, Name, ShortText, Token

__all__ = ["MAX_MESSAGE_BYTES", "Arg", "Message", "Name", "ShortText", "Strict", "utc_now"]

MAX_MESSAGE_BYTES = 256 * 1024
"""A message body larger than this is refused by publishers and dead-lettered by consumers."""


def utc_now() -> datetime:
    return datetime.now(UTC)


class Strict(BaseModel):
    """Base of every contract model: unknown fields are errors, instances are immutable, and a float is finite
    (``NaN`` and ``Infinity``, which JSON readers differ on and PostgreSQL ``jsonb`` refuses, are validation errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False, allow_inf_nan=False)


class Message(Strict):
    """Envelope fields shared by every command and event.

    Subclasses set ``TYPE`` (the message type, also the default routing key for events) and ``type`` as a literal
    of the same value so that decoding picks the right model.
    """

    TYPE: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1

    message_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    type: str
    schema_version: int = Field(default=1, ge=1, le=1000)
    occurred_at: datetime = Field(default_factory=utc_now)
    producer: Token = "unknown"
