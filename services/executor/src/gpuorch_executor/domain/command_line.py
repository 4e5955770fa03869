"""What a job's argv makes its program run: a script file, a module, or code that is not in a file on the node.

The allow-list (``allowlist``) names the programs a tenant may start; this module reads the rest of the argv the
way the program itself will, so that an allowed interpreter cannot be handed code on its command line (or on its
standard input) by a tenant whose allow-list entry does not say ``"inline_code": true``.

    argv --read_command_line--> CommandLine
        program is not an interpreter this module knows         -> nothing to judge (the command itself is allowed)
        program runs another program named in its argv (env, timeout, nice, xargs, sudo, busybox ...)
                                                                 -> inline: the program it runs is not judged
        interpreter: options before the program, read one by one against its ``Syntax``
            an option that takes code (-c, -e, --eval ...), or makes it interactive (-i)   -> inline
            an option not on the interpreter's list of known-harmless ones                  -> inline (unknown)
            -m MODULE (python)                                  -> module (the allow-list says which may run)
            a script file (or php -f / awk -f FILE)             -> script, unless it is standard input in
                                                                   disguise: ``-``, /dev/..., /proc/..., a URL
            no program at all (``python``, ``bash -s``)         -> inline: it would read its program from stdin
            awk, sed: the first operand *is* the program         -> inline, unless the program came from -f FILE

An allow-list of known-safe forms, not a deny-list of known-bad ones: an interpreter's option that is not listed
in its ``Syntax`` is refused, so a flag this module never heard of (a new interpreter release, ``perl -M'5;...'``,
``node --import``, ``bash --rcfile``) cannot carry code past it. The tables are kept small on purpose: a job runs a
script file, with at most a few options that change no code (``python -u -B -W error``, ``bash -eu``).

Pure: no I/O (paths are judged as text; the executor resolves ``argv[0]`` itself).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

ValueCheck = Callable[[str], str | None]
"""An option's value -> why that value makes the program run code that is not a script file (None: harmless)."""

LongKind = str
"""How a long option is read: ``flag``, ``value`` (``--x=V`` or ``--x V``), ``optional`` (``--x`` or ``--x=V``),
``code`` (runs code given on the command line), ``script`` (its value is the program file)."""


@dataclass(frozen=True)
class Syntax:
    """The command line of one interpreter family, as far as a job may use it without inline code.

    Short options are letters of a word starting with ``-`` (clustered: ``-Bu``); ``valued`` letters take the rest
    of the word or the next word as their value; ``attached`` letters take an optional value from the rest of the
    word only, matching their pattern (``perl -l0``). Any letter in none of the sets is refused."""

    flags: str = ""
    valued: str = ""
    attached: Mapping[str, str] = field(default_factory=dict)
    code: str = ""
    """Letters that run code given with them or typed at a prompt (``-c``, ``-e``, ``-i``, ``-s`` for shells)."""
    script: str = ""
    """Letters whose value is the program file (``php -f``, ``awk -f``)."""
    module: str = ""
    """The letter whose value is a module to run (``python -m``)."""
    long: Mapping[str, LongKind] = field(default_factory=dict)
    value_checks: Mapping[str, ValueCheck] = field(default_factory=dict)
    """Per option (``-W``, ``--x``): a check of its value."""
    plus_options: bool = False
    """Shells: ``+o name``, ``+e`` unset options, read like ``-`` words."""
    operand_is_program: bool = False
    """awk, sed: the first operand is the program text itself, unless a script option named a file."""
    subcommands: frozenset[str] = frozenset()
    """deno, bun: the first operand must be one of these (``run``) before the script."""


@dataclass(frozen=True)
class CommandLine:
    """What an argv runs. ``inline`` says how it runs code that is not in a script file on the node (None: it
    does not); ``module`` is the module it runs (python ``-m``), ``script`` the program file, as written."""

    program: str
    inline: str | None = None
    module: str | None = None
    script: str | None = None


def _python_warning_filter(value: str) -> str | None:
    """``-W action:message:category:module:lineno``: a dotted category is imported (its module's code runs)."""
    parts = value.split(":")
    category = parts[2].strip() if len(parts) > 2 else ""
    if "." in category:
        return f"-W {value!r} imports module {category.rsplit('.', 1)[0]!r} (a warning category outside builtins)"
    return None


PYTHON_X_OPTIONS = frozenset({
    "utf8", "dev", "faulthandler", "tracemalloc", "importtime", "showrefcount", "pycache_prefix",
    "warn_default_encoding", "no_debug_ranges", "frozen_modules", "int_max_str_digits", "perf", "cpu_count", "gil",
    "perf_jit", "context_aware_warnings", "thread_inherit_context", "lazy_imports",
})
"""``-X`` options that change no code (``-X presite=MODULE`` and any option not listed here are refused)."""


def _python_x_option(value: str) -> str | None:
    name = value.split("=", 1)[0]
    if name not in PYTHON_X_OPTIONS:
        return f"-X {value!r} is not a known-harmless -X option ({', '.join(sorted(PYTHON_X_OPTIONS))})"
    return None


PYTHON = Syntax(
    flags="bBdEhIOqsSuvVxPR?", valued="WX", code="ci", module="m",
    long={"--help": "flag", "--version": "flag", "--help-env": "flag", "--help-xoptions": "flag",
          "--help-all": "flag", "--check-hash-based-pycs": "value"},
    value_checks={"-W": _python_warning_filter, "-X": _python_x_option},
)
"""``python [-bBdEIOPqsSuvVx] [-W filter] [-X opt] (script | -m module) [args]``. ``-c``: code; ``-i``: a prompt
after the script (code from stdin); ``-`` or nothing: the program is read from stdin."""

SHELL = Syntax(
    flags="eufxvnaCbhBHPTkmr", valued="oO", code="cis", plus_options=True,
    long={"--norc": "flag", "--noprofile": "flag", "--posix": "flag", "--restricted": "flag", "--noediting": "flag",
          "--command": "code", "--rcfile": "code", "--init-file": "code", "--login": "code",
          "--help": "flag", "--version": "flag", "--verbose": "flag"},
)
"""``bash [-eux] [-o option] script [args]``. ``-c``: a command string; ``-s``: commands from stdin; ``-i``,
``-l``/``--login``, ``--rcfile``: interactive or profile files that run before anything."""

NODE = Syntax(
    flags="", code="eip",
    long={"--eval": "code", "--print": "code", "--interactive": "code", "--enable-source-maps": "flag",
          "--no-warnings": "flag", "--max-old-space-size": "value", "--stack-size": "value", "--trace-warnings": "flag",
          "--no-deprecation": "flag", "--unhandled-rejections": "value", "--version": "flag", "--help": "flag"},
)
"""``node [--enable-source-maps ...] script.js [args]``; ``-r``/``--require``/``--import`` (preloaded code),
``--inspect`` (a debugger port: remote code) and every other option are refused."""

DENO = Syntax(flags="Aq", long={"--allow-all": "flag", "--quiet": "flag", "--no-prompt": "flag",
                                "--allow-read": "optional", "--allow-write": "optional", "--allow-net": "optional",
                                "--allow-env": "optional"}, subcommands=frozenset({"run"}))
BUN = Syntax(code="ep", long={"--eval": "code", "--print": "code", "--smol": "flag"},
             subcommands=frozenset({"run"}))
PERL = Syntax(flags="wWXtTUsSanpx", valued="I", code="eEMmd",
              attached={"l": "[0-7]*", "0": "[0-7xX0-9a-fA-F]*", "C": ".*"},
              long={"--help": "flag", "--version": "flag"})
"""``perl [-wT] [-I dir] script [args]``; ``-M``/``-m`` (``-M'5;code'`` runs code), ``-e``/``-E``, ``-d``
(a debugger module) are inline code."""
RUBY = Syntax(flags="wvlnpasSUx", valued="IEC", attached={"W": "[0-2]?", "K": "[a-zA-Z]?"}, code="er",
              long={"--help": "flag", "--version": "flag", "--disable-gems": "flag", "--verbose": "flag"})
PHP = Syntax(flags="nqHe", code="rRBEFa", script="f", long={"--help": "flag", "--version": "flag"})
RSCRIPT = Syntax(code="e", long={"--vanilla": "flag", "--no-environ": "flag", "--no-site-file": "flag",
                                 "--no-init-file": "flag", "--verbose": "flag", "--default-packages": "value",
                                 "--version": "flag", "--help": "flag"})
JULIA = Syntax(flags="q", valued="tpO", code="eEiL",
               long={"--threads": "value", "--procs": "value", "--project": "optional", "--startup-file": "value",
                     "--color": "value", "--history-file": "value", "--check-bounds": "value",
                     "--optimize": "optional", "--heap-size-hint": "value", "--quiet": "flag",
                     "--eval": "code", "--print": "code", "--load": "code", "--version": "flag", "--help": "flag"})
LUA = Syntax(flags="EWv", code="eil")
AWK = Syntax(valued="vF", script="f", code="e", operand_is_program=True,
             long={"--file": "script", "--source": "code", "--assign": "value", "--field-separator": "value",
                   "--exec": "code", "--version": "flag", "--help": "flag"})
"""``awk -f prog.awk [files]``: the first operand of ``awk 'program'`` is code."""
SED = Syntax(flags="nErsuz", valued="l", code="e", script="f", operand_is_program=True,
             long={"--expression": "code", "--file": "script", "--quiet": "flag", "--silent": "flag",
                   "--regexp-extended": "flag", "--separate": "flag", "--null-data": "flag", "--version": "flag"})

INTERPRETERS: tuple[tuple[re.Pattern[str], Syntax], ...] = (
    (re.compile(r"^(python|pypy)[0-9.]*$"), PYTHON),
    (re.compile(r"^(sh|bash|dash|zsh|ksh|mksh|ash|fish|csh|tcsh|rbash|yash|oksh|pdksh)$"), SHELL),
    (re.compile(r"^(node|nodejs)[0-9.]*$"), NODE),
    (re.compile(r"^deno$"), DENO),
    (re.compile(r"^bun$"), BUN),
    (re.compile(r"^perl[0-9.]*$"), PERL),
    (re.compile(r"^ruby[0-9.]*$"), RUBY),
    (re.compile(r"^php[0-9.]*$"), PHP),
    (re.compile(r"^Rscript$"), RSCRIPT),
    (re.compile(r"^julia[0-9.]*$"), JULIA),
    (re.compile(r"^(lua|luajit)[0-9.]*$"), LUA),
    (re.compile(r"^(awk|gawk|mawk|nawk|busybox-awk)$"), AWK),
    (re.compile(r"^(sed|gsed)$"), SED),
)

RUNS_ANOTHER_PROGRAM: frozenset[str] = frozenset({
    "env", "nice", "nohup", "timeout", "stdbuf", "taskset", "numactl", "ionice", "chrt", "setsid", "time",
    "xargs", "sudo", "su", "doas", "runuser", "chroot", "unshare", "nsenter", "flock", "watch", "parallel",
    "strace", "ltrace", "gdb", "valgrind", "perf", "script", "expect", "busybox", "toybox", "find", "exec",
    "eval", "command", "builtin", "start-stop-daemon", "systemd-run", "setpriv", "capsh", "prlimit", "firejail",
    "bwrap", "tclsh", "wish", "vim", "vi", "nvim", "emacs", "ssh", "make", "cmake", "ninja",
})
"""Programs that run another program (or their own language) given on their command line: the allow-list could
not judge what they run, so they count as inline code."""

STDIN_PATHS = re.compile(r"^/(dev|proc)(/|$)")


def script_refusal(path: str, cwd: str | None) -> str | None:
    """Why ``path``, given as a program file, is not a file on the node: stdin (``-``), a device or ``/proc``
    entry (``/dev/stdin``, ``/dev/fd/0``, ``/proc/self/fd/0``; also reached through ``..``), or a URL."""
    if path == "-":
        return "reads its program from standard input ('-')"
    if "://" in path:
        return f"runs a program from a URL ({path[:80]!r}), not a file on the node"
    if os.path.isabs(path):
        candidate = os.path.normpath(path)
    elif cwd is not None and os.path.isabs(cwd):
        candidate = os.path.normpath(os.path.join(cwd, path))
    else:  # relative to a directory not known here: a path climbing out of it may end anywhere
        parts = [p for p in os.path.normpath(path).split("/") if p not in ("", ".")]
        climbed = bool(parts) and parts[0] == ".."
        while parts and parts[0] == "..":
            parts.pop(0)
        candidate = "/" + "/".join(parts) if climbed else ""
    if STDIN_PATHS.match(candidate):
        return f"runs {path!r}, a device or /proc entry (standard input in disguise), not a program file"
    return None


def read_command_line(argv: Sequence[str], cwd: str | None = None, executable: str | None = None) -> CommandLine:
    """What ``argv`` runs (module docstring); ``cwd`` is the job's working directory when the spec names one,
    ``executable`` the file ``argv[0]`` resolved to, symlinks followed (an allowed ``/opt/bin/train`` that is a
    link to python is read as python)."""
    program = os.path.basename(argv[0]) if argv else ""
    names = [program] + ([os.path.basename(executable)] if executable else [])
    runner = next((n for n in names if n in RUNS_ANOTHER_PROGRAM), None)
    if runner is not None:
        return CommandLine(program, inline=f"{program} runs the program named on its command line, which the "
                                           "allow-list does not judge")
    syntax = next((s for name in names for pattern, s in INTERPRETERS if pattern.match(name)), None)
    if syntax is None:
        return CommandLine(program)
    return _Reader(program, syntax, list(argv[1:]), cwd).read()


@dataclass
class _Reader:
    """One pass over an interpreter's arguments, word by word, as the interpreter reads them."""

    program: str
    syntax: Syntax
    words: list[str]
    cwd: str | None
    at: int = 0
    script: str | None = None
    subcommand_seen: bool = False

    def _next_word(self) -> str | None:
        if self.at < len(self.words):
            self.at += 1
            return self.words[self.at - 1]
        return None

    def _inline(self, how: str) -> CommandLine:
        return CommandLine(self.program, inline=how)

    def read(self) -> CommandLine:
        syntax = self.syntax
        while (word := self._next_word()) is not None:
            if word == "--":
                return self._operand(self._next_word())
            if word.startswith("--"):
                found = self._long(word)
            elif (word.startswith("-") or (syntax.plus_options and word.startswith("+"))) and word != "-":
                found = self._short(word)
            else:
                if syntax.subcommands and not self.subcommand_seen:
                    if word not in syntax.subcommands:
                        return self._inline(f"{self.program} {word}: only {' or '.join(sorted(syntax.subcommands))} "
                                            "a script file")
                    self.subcommand_seen = True
                    continue
                return self._operand(word)
            if found is not None:
                return found
        return self._operand(None)

    def _operand(self, word: str | None) -> CommandLine:
        """The first operand: the program file (or, for awk and sed without -f, the program text)."""
        if self.script is not None:
            return CommandLine(self.program, script=self.script)
        if self.syntax.operand_is_program:
            return self._inline(f"{self.program} runs the program text given as its first operand; give -f FILE")
        if word is None:
            return self._inline(f"{self.program} without a script file reads its program from standard input")
        refused = script_refusal(word, self.cwd)
        if refused is not None:
            return self._inline(f"{self.program} {refused}")
        return CommandLine(self.program, script=word)

    def _program_file(self, option: str, value: str | None) -> CommandLine | None:
        if value is None:
            return self._inline(f"{self.program} {option} without a file")
        refused = script_refusal(value, self.cwd)
        if refused is not None:
            return self._inline(f"{self.program} {option} {refused}")
        self.script = value
        return None

    def _checked(self, option: str, value: str | None) -> CommandLine | None:
        if value is None:
            return self._inline(f"{self.program} {option} without its value")
        check = self.syntax.value_checks.get(option)
        why = check(value) if check is not None else None
        return self._inline(f"{self.program} {why}") if why is not None else None

    def _long(self, word: str) -> CommandLine | None:
        name, has_value, value = word.partition("=")
        kind = self.syntax.long.get(name)
        if kind is None:
            known = ", ".join(sorted(self.syntax.long)) or "none"
            return self._inline(f"{self.program} option {name} is not one known to run no code (known: {known})")
        if kind == "code":
            return self._inline(f"{self.program} {name} runs code given on its command line or typed at a prompt")
        if kind == "flag":
            return self._inline(f"{self.program} {name} takes no value") if has_value else None
        if kind == "optional":
            return self._checked(name, value) if has_value else None
        if not has_value:
            value = self._next_word() or ""
        if kind == "script":
            return self._program_file(name, value)
        return self._checked(name, value)

    def _short(self, word: str) -> CommandLine | None:
        syntax = self.syntax
        letters = word[1:]
        i = 0
        while i < len(letters):
            letter, rest = letters[i], letters[i + 1:]
            option = f"{word[0]}{letter}"
            if letter in syntax.code:
                return self._inline(f"{self.program} {option} runs code given on its command line, from standard "
                                    "input or typed at a prompt")
            if letter in syntax.module:
                module = rest or self._next_word()
                if not module:
                    return self._inline(f"{self.program} {option} without a module")
                return CommandLine(self.program, module=module)
            if letter in syntax.script:
                return self._program_file(option, rest or self._next_word())
            if letter in syntax.valued:
                return self._checked(f"-{letter}", rest or self._next_word())
            if letter in syntax.attached:
                match = re.match(syntax.attached[letter], rest)
                i += 1 + (len(match.group(0)) if match else 0)
                continue
            if letter not in syntax.flags:
                known = "".join(sorted(set(syntax.flags + syntax.valued + "".join(syntax.attached))))
                return self._inline(f"{self.program} option {option} is not one known to run no code "
                                    f"(known: {('-' + known) if known else 'none'})")
            i += 1
        return None
