"""The message envelope every gpuorch message carries, and bounded field types.

Contract:
- every message is a pydantic model with ``extra="forbid"``: an unknown field is a validation error, never ignored;
- ``message_id`` is the idempotency key: a consumer that sees the same id twice applies it once;
- ``type`` names the message (``job.submit``, ``job.placed`` ...) and selects the model on decode;
- ``schema_version`` starts at 1; a breaking change is a new version handled side by side, compatible changes only
  add optional fields;
- ``occurred_at`` is timezone-aware UTC; ``producer`` names the emitting service instance.
The W3C ``traceparent`` travels in AMQP headers, not in the body (see gpuorch_messaging).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]
"""An identifier-like string: node ids, tenants, GPU models, profile names."""

ShortText = Annotated[str, StringConstraints(max_length=1024)]
"""Free text meant for people (reasons, explanations), bounded."""

Arg = Annotated[str, StringConstraints(max_length=4096)]
"""One argv element or environment value."""

MAX_MESSAGE_BYTES = 256 * 1024
"""A message body larger than this is refused by publishers and dead-lettered by consumers."""


def utc_now() -> datetime:
    return datetime.now(UTC)


class Strict(BaseModel):
    """Base of every contract model: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


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
    producer: Annotated[str, StringConstraints(min_length=1, max_length=128)] = "unknown"
