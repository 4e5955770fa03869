"""Text from the fleet, made safe to print on an operator's terminal.

Job names, tenants, reasons, node ids and logs come from other people and other machines. Printed as they are, an
ESC or OSC sequence would recolour, clear or retitle the operator's terminal, plant a hyperlink or write the
clipboard (OSC 52), and a ``[`` would be read by rich as markup (``[/]`` crashes a table). Every value gpuctl prints
that it did not write itself goes through one of these:

    cell(value)      one line for a rich table cell or a markup string: controls made visible, markup escaped
    markup(value)    the same, keeping line breaks (describe, error messages)
    log_output(text) a job's own output: escape sequences removed (colours are lost, nothing reaches the terminal)

"Made visible" means a control character is shown as its escape (``ESC`` as ``\\x1b``, a bidi override as
``\\u202e``), so an operator sees that something was there. JSON output (``--json``) is left alone: JSON escapes
control characters itself.
"""

from __future__ import annotations

import re

from rich.markup import escape

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_LINE_BREAKS = re.compile("[\t\n]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def neutralised(value: object, *, one_line: bool = False) -> str:
    """``str(value)`` with every terminal control character shown as its escape; TAB and LF are kept, or become
    spaces when ``one_line``. Pure: the result holds no C0 (but TAB/LF), DEL, C1, bidi control or surrogate."""
    text = _CONTROL.sub(_visible, "" if value is None else str(value))
    return _LINE_BREAKS.sub(" ", text) if one_line else text


def cell(value: object) -> str:
    """A value for a rich table cell (or inside a markup string): one line, neutralised, markup escaped."""
    return escape(neutralised(value, one_line=True))


def markup(value: object) -> str:
    """A value inside a rich markup string, keeping line breaks: neutralised, markup escaped."""
    return escape(neutralised(value))


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
_REMOVED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def log_output(text: str) -> str:
    """A job's output for the terminal: escape sequences and control characters removed (TAB/LF kept; of a line
    redrawn with CR, only its last frame). The same as ``gpuorch_contracts.text.strip_terminal_controls`` (the
    thin client does not depend on the contracts; tests/test_terminal_text.py holds the two equal)."""
    text = _ESCAPE_SEQUENCE.sub("", text).replace("\r\n", "\n")
    if "\r" in text:
        text = "\n".join(([frame for frame in line.split("\r") if frame] or [""])[-1] for line in text.split("\n"))
    return _REMOVED.sub("", text)
