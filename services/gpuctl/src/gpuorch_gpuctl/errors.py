"""How every gpuctl command says it cannot do what was asked: one idiom.

    fail(message)         one line on stderr, ``gpuctl: <message>``, and exit 1: it could not be done (a server out
                          of reach, refused, not found, timed out; a result that is a failure)
    fail(message, 2)      the same line, exit 2: the request itself is wrong (a job spec that does not validate, a
                          missing combination of options, a config file or an environment variable that is not
                          valid, the API's 400/422)
    typer.BadParameter    only for one option's or argument's value that is wrong in itself (a format, a choice, a
                          range, a file it names that cannot be read): typer's usage error, exit 2, as for its own
                          parse errors (``--state bogus``), raised before the command does anything

Nothing else: no printing followed by ``typer.Exit``, no ``sys.exit``, no exception left to end as a traceback
(``cli.main`` turns a server out of reach that no command caught into the same one line, exit 1).

On an error stdout stays empty, ``--json`` included; progress and diagnostics printed on stderr before it come
first, the ``gpuctl:`` line last. A command whose result is a failure prints its result as usual (``--json``: the
document) and then fails: ``submit --wait`` of a job that did not succeed (exit: the job's own exit code, else 1),
``demo`` short of its goal, ``db status`` with migrations that disagree, ``replay --verify`` with violations.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

USAGE = 2
"""The exit code of a request that is wrong in itself (typer's and argparse's code for a bad option)."""


def error_line(message: str) -> str:
    """``gpuctl: <message>`` on one line (line breaks and runs of spaces in ``message`` become single spaces)."""
    return f"gpuctl: {' '.join(message.split())}"


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error_line(message)`` on stderr and exit with ``code`` (no traceback)."""
    print(error_line(message), file=sys.stderr, flush=True)
    raise typer.Exit(code)
