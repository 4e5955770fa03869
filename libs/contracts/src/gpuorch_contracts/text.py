"""What text may travel in a message, and how untrusted text is made fit for it.

Every string field of every message is one of the annotated types below (a test walks the JSON Schemas to prove it):

- identifiers (``Name``, ``TenantName``, ``JobName``) match a safe ASCII pattern: no spaces, no markup, no
  control characters, nothing a shell, a terminal, rich markup or an AMQP topic pattern would read specially;
- one-line text (``Line``: hostnames, GPU uuids, paths, image references, label values) refuses every control
  character: C0 (U+0000-U+001F, NUL included), DEL (U+007F) and C1 (U+0080-U+009F);
- free text (``Text``, ``ShortText``, ``Arg``: reasons, explanations, argv elements, environment values) allows TAB
  and LF only, and refuses every other control character, CR included (a CR lets text overwrite what a terminal
  already shows);
- every string refuses lone UTF-16 surrogates (U+D800-U+DFFF), which JSON may spell as ``\\ud800`` but which neither
  UTF-8 nor PostgreSQL ``jsonb`` can hold.

NUL and the other refused characters are errors, never silently dropped: a producer that holds untrusted text (a
job's output, a library's error message) passes it through ``output_tail_text`` first, which strips terminal escape
sequences and control characters and keeps the tail within a length (``reason_text`` keeps the head instead).

The JSON Schema of each type carries the pattern (ECMA-262 syntax) so other systems can check before sending; the
surrogate rule is enforced here only (a code-unit pattern would also refuse valid surrogate pairs such as emoji).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, GetCoreSchemaHandler, GetJsonSchemaHandler, StringConstraints
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

_LINE_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_TEXT_FORBIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
LINE_PATTERN = r"^[^\u0000-\u001f\u007f-\u009f]*$"
"""JSON Schema pattern of one-line text: no control character at all."""
TEXT_PATTERN = r"^[^\u0000-\u0008\u000b-\u001f\u007f-\u009f]*$"
"""JSON Schema pattern of free text: no control character but TAB and LF."""


@dataclass(frozen=True)
class RefuseControlCharacters:
    """Annotation for a ``str``: refuse control characters (TAB and LF too unless ``multiline``) and surrogates.

    The error names the first offending character and its position, so a rejection reason is actionable.
    """

    multiline: bool

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler,
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema.setdefault("pattern", TEXT_PATTERN if self.multiline else LINE_PATTERN)
        return json_schema

    def _check(self, value: str) -> str:
        found = (_TEXT_FORBIDDEN if self.multiline else _LINE_FORBIDDEN).search(value)
        if found is not None:
            allowed = "; only TAB and LF are allowed" if self.multiline else ""
            raise PydanticCustomError(
                "control_character",
                "control character U+{code} at position {position} is not allowed{allowed}",
                {"code": f"{ord(found.group()):04X}", "position": found.start(), "allowed": allowed},
            )
        return value


ONE_LINE = RefuseControlCharacters(multiline=False)
MULTILINE = RefuseControlCharacters(multiline=True)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NAME_PATTERN)]
"""An identifier: node ids, GPU models, MIG profiles, label and environment keys, detection kinds."""

TENANT_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
TenantName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=TENANT_PATTERN)]
"""A tenant (team): lower-case letters, digits, ``-`` and ``_``; one word of a routing key, a label in metrics."""

JobName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NAME_PATTERN)]
"""A job's name, chosen by its submitter and shown to people: the ``Name`` alphabet (no spaces or markup)."""

GpuUuid = Annotated[str, StringConstraints(min_length=1, max_length=96), ONE_LINE]
"""A GPU or MIG instance UUID as the driver spells it (``GPU-...``, ``MIG-...``, ``MIG-GPU-.../1/0``)."""

MigProfileName = Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=NAME_PATTERN)]
"""A MIG profile (``1g.10gb``, ``3g.40gb``, ``1c.2g.20gb``)."""

ShortText = Annotated[str, StringConstraints(max_length=1024), MULTILINE]
"""Free text meant for people (reasons, explanations): TAB and LF allowed, at most 1024 characters."""

Arg = Annotated[str, StringConstraints(max_length=4096), MULTILINE]
"""One argv element or environment value (inline code may span lines)."""

Hostname = Annotated[str, StringConstraints(max_length=255), ONE_LINE]
PathText = Annotated[str, StringConstraints(max_length=1024), ONE_LINE]
LabelValue = Annotated[str, StringConstraints(max_length=256), ONE_LINE]
Token = Annotated[str, StringConstraints(min_length=1, max_length=128), ONE_LINE]
"""A short opaque value produced by a machine: hashes, container ids, producer names."""
OptionalToken = Annotated[str, StringConstraints(max_length=128), ONE_LINE]

MAX_SAFE_INTEGER = 2**53 - 1
"""Largest integer every JSON reader holds exactly (JavaScript's ``Number.MAX_SAFE_INTEGER``)."""
Count = Annotated[int, Field(ge=0, le=MAX_SAFE_INTEGER)]
MiB = Annotated[int, Field(ge=0, le=16_777_216)]
"""A memory size in MiB, at most 16 TiB (fits a PostgreSQL ``integer``)."""
Seconds = Annotated[float, Field(ge=0, le=10**9)]
"""A duration, at most about 31 years."""

# ---------------------------------------------------------------------------------------------------------------
# Sanitising untrusted text before it enters a message
# ---------------------------------------------------------------------------------------------------------------

_ESCAPE_SEQUENCE = re.compile(
    r"""
      \x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?     # OSC ... BEL/ST (titles, hyperlinks, clipboard writes)
    | \x9d[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?       # OSC, C1 form
    | \x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c)?          # DCS / SOS / PM / APC strings
    | [\x90\x98\x9e\x9f][^\x1b\x9c]*(?:\x1b\\|\x9c)?  # the same, C1 form
    | \x1b\[[0-?]*[ -/]*[@-~]?                        # CSI (colours, cursor moves, screen clears)
    | \x9b[0-?]*[ -/]*[@-~]?                          # CSI, C1 form
    | \x1b[ -/]*[0-~]?                                # other ESC sequences (charset switches, resets)
    """,
    re.VERBOSE,
)
_BIDI_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069]")
"""Bidirectional overrides and isolates: they reorder what a reader sees (Trojan Source)."""


def strip_terminal_controls(text: str) -> str:
    """Remove terminal escape sequences (CSI, OSC, DCS ...), bidi overrides and control characters from ``text``.

    TAB and LF are kept. A CR ends a progress-bar frame: of each line only what follows its last CR is kept (what
    a terminal would have shown), so ``"10%\\r50%\\r100%"`` becomes ``"100%"``. The result is valid free text
    (``Text``/``ShortText``) of any length.
    """
    text = _ESCAPE_SEQUENCE.sub("", text)
    text = text.replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(_last_frame(line) for line in text.split("\n"))
    text = _BIDI_CONTROLS.sub("", text)
    return _TEXT_FORBIDDEN.sub("", text)


def _last_frame(line: str) -> str:
    frames = [frame for frame in line.split("\r") if frame]
    return frames[-1] if frames else ""


def reason_text(text: str | bytes, max_chars: int = 1024) -> str:
    """The start of an untrusted message (a library's error, ``str(validation_error)``), fit for a free-text
    field of at most ``max_chars`` characters: cleaned like ``output_tail_text``, but the beginning is kept and a
    trailing ``…`` marks a cut. The result always passes ``ShortText`` when ``max_chars <= 1024``. Pure: no I/O."""
    if max_chars < 1:
        raise ValueError("max_chars must be at least 1")
    decoded = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    cleaned = strip_terminal_controls(decoded).strip()
    if len(cleaned) > max_chars:
        cleaned = cleaned[:max_chars - 1].rstrip() + "…"
    return cleaned


def output_tail_text(output: str | bytes, max_chars: int = 1024) -> str:
    """The end of a process's output, fit for a free-text field of at most ``max_chars`` characters.

    Bytes are decoded as UTF-8 (undecodable bytes become U+FFFD); escape sequences and control characters are
    removed (``strip_terminal_controls``); surrounding whitespace is trimmed; when the result is longer than
    ``max_chars`` its last ``max_chars - 1`` characters are kept behind a leading ``…``. The result always passes
    ``ShortText`` when ``max_chars <= 1024``. Pure: no I/O.
    """
    if max_chars < 1:
        raise ValueError("max_chars must be at least 1")
    text = output.decode("utf-8", errors="replace") if isinstance(output, bytes) else output
    text = strip_terminal_controls(text).strip()
    if len(text) > max_chars:
        text = "…" + text[len(text) - (max_chars - 1):].lstrip() if max_chars > 1 else "…"
    return text
