"""Escalation 4 of issue 29: an allowed interpreter handed code on its command line or its standard input.

The allow-list judges the whole argv (``gpuorch_executor.domain.command_line``): every form below runs code that is
not a script file on the node, and is refused for a tenant whose entry lacks ``"inline_code": true`` (and runs for
one that has it). Scripts, allowed modules and known-harmless options still run. One test sends a forbidden form to
the real ``gpuorch-executor`` through the real broker and sees the refusal, with its reason, come back.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from gpuorch_contracts import JobFailed, ProcessRun
from gpuorch_executor.domain.allowlist import AllowListError, load_allow_list
from gpuorch_messaging import Broker

from services.executor.tests.conftest import launch_job
from services.executor.tests.test_integration_broker import (
    TERMINAL,
    EventTap,
    ExecutorProcess,
    for_node,
    kill_leftovers,
    publish_when_routable,
)

pytestmark = pytest.mark.security

COMMANDS = ["python", "python3", "python3.12", "sh", "bash", "zsh", "node", "perl", "ruby", "php", "Rscript", "julia",
            "lua", "awk", "gawk", "sed", "deno", "bun", "env", "timeout", "busybox", "xargs", "nice"]
STRICT = load_allow_list(json.dumps({"tenants": {"t": {"commands": COMMANDS, "modules": ["train", "mylab.*"]}}}))
TRUSTED = load_allow_list(json.dumps({"tenants": {"t": {"commands": COMMANDS, "inline_code": True}}}))

INLINE_FORMS: list[tuple[list[str], str | None]] = [
    # python: code options, alone, clustered, attached, after other options
    (["python3", "-c", "import os"], None), (["python", "-Bc", "x"], None), (["python3", "-cimport os"], None),
    (["python3", "-u", "-c", "x"], None), (["python3", "-W", "ignore", "-c", "x"], None),
    (["python3", "-Wignore", "-Ec", "x"], None), (["python3.12", "-I", "-c", "x"], None),
    # python: modules that run code given to them
    (["python3", "-m", "timeit", "-s", "import os", "os.system('id')"], None),
    (["python3", "-mtimeit", "pass"], None), (["python3", "-m", "pdb", "-c", "import os", "train.py"], None),
    (["python3", "-m", "code"], None), (["python3", "-m", "runpy"], None), (["python3", "-m", "cProfile", "-m", "x"], None),
    (["python3", "-m", "pip", "install", "evil"], None), (["python3", "-m", "asyncio"], None),
    # python: the program from standard input, a device or /proc
    (["python3"], None), (["python3", "-"], None), (["python3", "-u", "-"], None), (["python3", "--"], None),
    (["python3", "/dev/stdin"], None), (["python3", "/dev/fd/0"], None), (["python3", "/proc/self/fd/0"], None),
    (["python3", "/proc/1/fd/0"], None), (["python3", "../../../../../../dev/stdin"], None),
    (["python3", "stdin"], "/dev"), (["python3", "fd/0"], "/dev"), (["python3", "self/fd/0"], "/proc"),
    (["python3", "-u", "/dev/./stdin"], None),
    # python: a prompt after the script, options that import or run code
    (["python3", "-i", "train.py"], None), (["python3", "-iu", "train.py"], None),
    (["python3", "-W", "ignore::evil.Warning", "train.py"], None), (["python3", "-X", "presite=evil", "train.py"], None),
    (["python3", "--unknown-option", "train.py"], None), (["python3", "-J", "train.py"], None),
    # shells
    (["sh", "-c", "id"], None), (["bash", "-lc", "id"], None), (["bash", "-ec", "id"], None), (["zsh", "-c", "id"], None),
    (["bash", "--command", "id"], None), (["bash", "-s"], None), (["bash"], None), (["sh", "-"], None),
    (["bash", "/dev/stdin"], None), (["bash", "-i", "job.sh"], None), (["bash", "--rcfile", "x", "job.sh"], None),
    (["bash", "--login", "job.sh"], None), (["bash", "-l", "job.sh"], None),
    # node, deno, bun
    (["node", "-e", "x"], None), (["node", "--eval=x"], None), (["node", "-p", "1"], None), (["node"], None),
    (["node", "-"], None), (["node", "-r", "./hook", "server.js"], None), (["node", "--import", "x", "s.js"], None),
    (["node", "--inspect=0.0.0.0:9229", "server.js"], None), (["deno", "eval", "x"], None), (["deno"], None),
    (["deno", "run", "https://example.com/x.ts"], None), (["bun", "-e", "x"], None), (["bun", "x", "cowsay"], None),
    # perl, ruby, php, R, julia, lua
    (["perl", "-e", "x"], None), (["perl", "-E", "say 1"], None), (["perl", "-lne", "print"], None),
    (["perl", "-M5;system('id')", "script.pl"], None), (["perl", "-d", "script.pl"], None), (["perl"], None),
    (["ruby", "-e", "x"], None), (["ruby", "-rsocket", "script.rb"], None), (["php", "-r", "x"], None),
    (["php", "-a"], None), (["php", "-d", "auto_prepend_file=/dev/stdin", "x.php"], None),
    (["php", "-f", "/dev/stdin"], None), (["Rscript", "-e", "x"], None), (["julia", "-e", "x"], None),
    (["julia", "-L", "setup.jl", "main.jl"], None), (["julia", "-i"], None), (["lua", "-e", "x"], None),
    (["lua", "-l", "evil", "script.lua"], None),
    # awk and sed: their first operand is the program
    (["awk", "BEGIN { system(\"id\") }"], None), (["gawk", "-e", "x", "-f", "p.awk"], None),
    (["sed", "1e id", "file"], None), (["sed", "-e", "s/a/b/", "file"], None),
    # programs that run the program named on their command line
    (["env", "python3", "-c", "x"], None), (["env", "python3", "train.py"], None),
    (["timeout", "10", "python3", "train.py"], None), (["busybox", "sh", "-c", "id"], None),
    (["xargs", "python3"], None), (["nice", "python3", "train.py"], None), (["busybox", "wget", "http://x"], None),
]

SCRIPT_FORMS: list[tuple[list[str], str | None]] = [
    (["python3", "train.py", "--epochs", "3", "-c", "config.yaml", "-"], None), (["python3", "-u", "-B", "t.py"], None),
    (["python3", "-W", "error", "t.py"], None), (["python3", "-Wignore::DeprecationWarning", "t.py"], None),
    (["python3", "-X", "utf8", "-X", "importtime", "t.py"], None), (["python3", "--", "t.py"], None),
    (["python3", "-m", "train", "-c", "x"], None), (["python3", "-m", "mylab.jobs.finetune"], None),
    (["python3", "-m", "mylab"], None), (["python3", "/opt/jobs/train.py"], None), (["python3", "jobs/t.py"], "/dev2"),
    (["python3", "../jobs/t.py"], None), (["bash", "-eu", "job.sh"], None), (["bash", "-o", "pipefail", "job.sh"], None),
    (["sh", "job.sh", "-c", "x"], None), (["bash", "+e", "job.sh"], None), (["node", "--enable-source-maps", "s.js"], None),
    (["node", "server.js", "-e", "x"], None), (["perl", "-w", "script.pl", "-e"], None), (["perl", "-l", "s.pl"], None),
    (["ruby", "-w", "script.rb"], None), (["php", "script.php"], None), (["php", "-f", "script.php"], None),
    (["Rscript", "--vanilla", "script.R"], None), (["julia", "-t", "4", "script.jl"], None),
    (["lua", "script.lua"], None), (["awk", "-f", "prog.awk", "data.txt"], None), (["sed", "-f", "p.sed", "f"], None),
    (["deno", "run", "-A", "script.ts"], None), (["bun", "run", "script.ts"], None),
]


def _check(allow: object, argv: list[str], cwd: str | None) -> str | None:
    refusal = allow.check_process("t", ProcessRun(argv=argv, workdir=cwd), f"/usr/bin/{argv[0]}")  # type: ignore[attr-defined]
    return refusal.reason if refusal is not None else None


@pytest.mark.parametrize(("argv", "cwd"), INLINE_FORMS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_each_form_that_runs_inline_code_is_refused_unless_the_tenant_allows_inline_code(
    argv: list[str], cwd: str | None
) -> None:
    reason = _check(STRICT, argv, cwd)
    assert reason is not None, f"{argv} ran for a tenant without inline_code"
    assert "inline_code" in reason and "'t'" in reason, reason
    assert _check(TRUSTED, argv, cwd) is None, f"{argv} refused although the tenant allows inline code"


@pytest.mark.parametrize(("argv", "cwd"), SCRIPT_FORMS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_scripts_allowed_modules_and_harmless_options_still_run(argv: list[str], cwd: str | None) -> None:
    assert _check(STRICT, argv, cwd) is None


def test_refusals_say_what_runs_the_code() -> None:
    reasons = {" ".join(argv): _check(STRICT, argv, None) or "" for argv in (
        ["python3", "-m", "timeit", "-s", "x"], ["python3", "/dev/stdin"], ["python3"], ["perl", "-M5;x", "s.pl"],
        ["env", "python3", "t.py"], ["python3", "-m", "other"])}
    assert "timeit" in reasons["python3 -m timeit -s x"]
    assert "/dev/stdin" in reasons["python3 /dev/stdin"] and "standard input" in reasons["python3 /dev/stdin"]
    assert "standard input" in reasons["python3"]
    assert "-M" in reasons["perl -M5;x s.pl"]
    assert "env runs the program" in reasons["env python3 t.py"]
    assert "'other'" in reasons["python3 -m other"] and "modules: mylab.*, train" in reasons["python3 -m other"]


@pytest.mark.parametrize("modules", [["timeit"], ["pdb"], ["IPython.*"], ["asyncio"], ["torch.distributed.run"]])
def test_code_running_modules_need_inline_code_in_the_allow_list_itself(modules: list[str]) -> None:
    with pytest.raises(AllowListError, match="inline_code"):
        load_allow_list(json.dumps({"tenants": {"t": {"commands": ["python3"], "modules": modules}}}))
    allowed = load_allow_list(json.dumps({"tenants": {"t": {"commands": ["python3"], "modules": modules,
                                                              "inline_code": True}}}))
    assert allowed.policy_for("t") is not None


def test_an_allowed_command_that_links_to_an_interpreter_is_read_as_that_interpreter(tmp_path: Path) -> None:
    link = tmp_path / "train"
    link.symlink_to(sys.executable)
    allow = load_allow_list(json.dumps({"tenants": {"t": {"commands": [str(link)]}}}))
    refused = allow.check_process("t", ProcessRun(argv=[str(link), "-c", "import os"]), str(link))
    assert refused is not None and "inline code" in refused.reason
    assert allow.check_process("t", ProcessRun(argv=[str(link), "job.py"]), str(link)) is None


def test_a_package_wildcard_does_not_reach_a_code_running_module() -> None:
    allow = load_allow_list(json.dumps({"tenants": {"t": {"commands": ["python3"], "modules": ["torch.*"]}}}))
    assert allow.check_process("t", ProcessRun(argv=["python3", "-m", "torch.utils.bench"]), "/usr/bin/python3") is None
    refused = allow.check_process("t", ProcessRun(argv=["python3", "-m", "torch.distributed.run", "--no-python",
                                                        "id"]), "/usr/bin/python3")
    assert refused is not None and "runs code" in refused.reason


@pytest.mark.integration
async def test_the_real_executor_refuses_python_m_timeit_and_says_why(amqp_url: str, tmp_path: Path) -> None:
    """``python3 -m timeit -s CODE`` sent to ``gpuorch-executor`` over the broker for a tenant without inline code:
    the job never runs (the file it would write does not appear) and ``JobFailed(cause=refused)`` names the form."""
    marker = tmp_path / f"ran-{uuid.uuid4().hex[:8]}"
    allow = json.dumps({"tenants": {"default": {"commands": ["python3"]}}})
    commander = Broker(amqp_url, producer="test/scheduler")
    await commander.connect()
    tap = EventTap(amqp_url)
    await tap.start()
    executor = ExecutorProcess(amqp_url, tmp_path / "state", "node-1", tmp_path / "executor.log",
                               GPUORCH_EXECUTOR_ALLOW=allow)
    executor.start()
    try:
        command = for_node(launch_job(["python3", "-m", "timeit", "-s", f"open({str(marker)!r}, 'w')", "pass"]),
                           "node-1")
        await publish_when_routable(commander, command)
        await tap.until(lambda: bool(tap.of(TERMINAL, command.placement_id)))
        [outcome] = tap.of(TERMINAL, command.placement_id)
        assert isinstance(outcome, JobFailed) and outcome.cause == "refused", outcome
        assert "-m timeit" in outcome.reason and "inline_code" in outcome.reason, outcome.reason
        assert not marker.exists()
        assert executor.process is not None and executor.process.poll() is None  # still serving
    finally:
        executor.terminate()
        kill_leftovers(tmp_path / "state")
        await tap.close()
        await commander.close()
