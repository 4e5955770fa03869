"""Who first sent a message: the original publisher, kept end to end across dead letters and replays.

RabbitMQ checks one thing: the AMQP ``user_id`` of a publish is the publishing connection's user (the *verified
publisher*). A message that is republished (dead-lettered by its consumer, replayed by an operator) gets the
republisher's ``user_id``, so the first publisher travels in one header, ``x-gpuorch-original-user-id``::

    publish          user_id U (verified)                          -> judged as U
    dead letter      consumer C republishes to gpuorch.dlx,          (C's Broker writes the header from
                     header = the publisher it judged (U, or "")      ``judged_publisher``, never from the body)
    replay           operator O republishes, header = U, after      -> judged as U; with "" (none): refused
                     ``recorded_publisher`` trusted the dead letter
    forged header    anyone but a relaying role sets the header     -> refused (strict), whatever it claims

``judged_publisher`` is what the consumer hands to its allow-list and handlers: a header is honoured only when
the verified publisher has a relaying role (``RELAYING_ROLES``: operators, whose broker grant publishes only to
``gpuorch.submit``, where an operator may already act for any tenant, so a claim can only narrow what the message
may do). ``recorded_publisher`` is what a replay trusts of a dead letter: the header only when the dead letter
was written by the consumer of that queue (the dead letter's own verified ``user_id``) and its type is one that
queue takes, so nobody can forge a dead letter that launders an identity into another queue's replay. Under
``trust_all`` (development: everyone is ``guest``) a header is taken as it is.

The API is not a relay: it publishes as its own gateway user and names ``on_behalf_of`` in the body
(``gpuorch_identity.acting_user``); a replayed API submission is judged as the API again, so as that caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpuorch_messaging.senders import Accepts, IdentityMode, speaker_of

ORIGINAL_PUBLISHER_HEADER = "x-gpuorch-original-user-id"
"""The broker-verified ``user_id`` of a message's first publisher ("" when it set none), on dead letters and on
replays."""
RELAYING_ROLES = frozenset({"operator"})
"""Roles whose publishes may carry another publisher's identity (``ORIGINAL_PUBLISHER_HEADER``)."""


@dataclass(frozen=True)
class Judged:
    """The identity a delivery is judged by (``publisher``: None when unknown), or why it is refused."""

    publisher: str | None
    refused: str | None = None


def header_text(headers: Mapping[str, Any] | None, name: str) -> str | None:
    """A header as text (AMQP tables carry bytes or str), None when absent."""
    value = (headers or {}).get(name)
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)


def judged_publisher(user_id: str | None, headers: Mapping[str, Any] | None, *, mode: IdentityMode = "strict",
                     node_scopes: Mapping[str, Collection[str]] | None = None) -> Judged:
    """Whom a delivery published by ``user_id`` (verified by RabbitMQ) with ``headers`` speaks for."""
    claimed = header_text(headers, ORIGINAL_PUBLISHER_HEADER)
    if claimed is None:
        return Judged(user_id or None)
    if mode == "trust_all":
        return Judged(claimed or user_id or None)
    role = speaker_of(user_id, node_scopes).role if user_id else None
    if role not in RELAYING_ROLES:
        sender = user_id or "a publisher without user_id"
        return Judged(None, f"{ORIGINAL_PUBLISHER_HEADER}={claimed!r} from {sender} (role {role or 'unknown'}): "
                            "only an operator replaying a dead letter may name another publisher")
    return Judged(claimed or None)


def recorded_publisher(
    queue: str, letter_user_id: str | None, headers: Mapping[str, Any] | None, body: bytes, *,
    accepts_of: Callable[[str], tuple[str, Accepts] | None],
) -> Judged:
    """The first publisher of a dead letter of ``queue`` (``refused``: why a replay must not trust it).

    ``letter_user_id`` is the dead letter's own verified ``user_id``: its consumer's when gpuorch dead-lettered
    it (then the header names the first publisher), the first publisher's when RabbitMQ did (no header: RabbitMQ
    keeps the properties). ``accepts_of(queue)`` gives the consumer role and allow-list of a gpuorch queue (None
    for another queue, whose dead letters are trusted only to name their own writer).
    """
    claimed = header_text(headers, ORIGINAL_PUBLISHER_HEADER)
    if claimed is None:
        publisher = letter_user_id or None
    elif claimed == letter_user_id:
        publisher = claimed
    else:
        known = accepts_of(queue)
        writer = speaker_of(letter_user_id).role if letter_user_id else None
        if known is None or writer != known[0]:
            return Judged(None, f"dead letter recorded by {letter_user_id or 'an unknown publisher'}, not by the "
                                f"consumer of {queue}: the original publisher it names ({claimed!r}) is not trusted")
        kind = message_type(body)
        if kind not in known[1]:
            return Judged(None, f"{queue} does not take {kind or 'a body without a type'}: not a dead letter of it")
        publisher = claimed or None
    if publisher is None:
        return Judged(None, "published without a user_id: a replay would make it the replayer's message")
    return Judged(publisher)


def message_type(body: bytes) -> str | None:
    """The ``type`` of a JSON message body, or None (not JSON, not an object, no string type)."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    return kind if isinstance(kind, str) else None
