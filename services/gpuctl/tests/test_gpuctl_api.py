"""gpuctl's commands against a live stack, through the API only: a team member with a token submits, watches,
reads logs from whichever node ran the job, and cancels its own jobs but not another team's."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from .conftest import TOKENS, Gpuctl, LiveApi

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PRINT_AND_WAIT = "import sys, time; print('first', flush=True); time.sleep(float(sys.argv[1])); print('last')"


def finish(process: subprocess.Popen[str], timeout_s: float = 60) -> tuple[str, str]:
    """What a spawned gpuctl printed (stdout, stderr) once it exited; killed after ``timeout_s``, so a hang fails
    with what it had printed."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, errors = process.communicate()
        return out, f"killed after {timeout_s}s; stderr: {errors}"


def lines_until(process: subprocess.Popen[str], start: str) -> str:
    """What a spawned gpuctl printed up to and including the first line that starts with ``start``."""
    assert process.stdout is not None
    seen = []
    while not (seen and seen[-1].startswith(start)):
        line = process.stdout.readline()
        assert line, f"ended before a line starting {start!r}: {''.join(seen)}"
        seen.append(line)
    return "".join(seen)


def test_contexts_versions_and_one_line_errors(gpuctl: Gpuctl, live_api: LiveApi) -> None:
    assert gpuctl.ok("--version").stdout.startswith("gpuctl ")
    nowhere = gpuctl("jobs")
    assert nowhere.exit_code == 1 and "no gpuorch API configured" in nowhere.stderr
    gpuctl.ok("config", "set-context", "acme", "--server", live_api.url, "--token", TOKENS["acme-team"])
    gpuctl.ok("config", "set-context", "down", "--server", "http://127.0.0.1:9", "--no-use")
    contexts = gpuctl.json("config", "get-contexts")
    assert [(c["name"], c["current"]) for c in contexts] == [("acme", True), ("down", False)]  # type: ignore[index]
    assert gpuctl.json("whoami")["tenants"] == ["acme"]  # type: ignore[index]

    unreachable = gpuctl("--context", "down", "jobs")
    assert unreachable.exit_code == 1 and unreachable.stderr.count("\n") == 1
    assert "cannot reach the gpuorch API" in unreachable.stderr
    assert gpuctl("jobs", "--state", "bogus").exit_code == 2
    assert gpuctl("--token", "wrong", "jobs").exit_code == 1
    assert gpuctl("events").exit_code == 0  # the recent ones (none yet), as kubectl get events lists them


def test_a_team_member_submits_watches_reads_logs_and_cancels(gpuctl: Gpuctl, live_api: LiveApi,
                                                              tmp_path: Path) -> None:
    gpuctl.ok("config", "set-context", "acme", "--server", live_api.url, "--token", TOKENS["acme-team"])
    nodes = gpuctl.json("nodes")
    assert sorted(n["node_id"] for n in nodes) == ["node-1", "node-2"]  # type: ignore[index]
    assert all(n["last_seen_s"] is not None and n["gpus_total"] >= 1 for n in nodes)  # type: ignore[index,union-attr]

    events = gpuctl.spawn("events", "--follow", "--json", "--count", "2", "--timeout", "60")
    watch = gpuctl.spawn("jobs", "-w", "-o", "json", "--timeout", "60", "--state", "succeeded")
    watch_yaml = gpuctl.spawn("jobs", "-w", "-o", "yaml", "--timeout", "60", "--state", "succeeded")
    for follower in (events, watch, watch_yaml):  # wait until each one's stream is open: what follows reaches it
        assert follower.stderr is not None and follower.stderr.readline().startswith("following ")
    assert watch.stdout is not None and json.loads(watch.stdout.readline()) == []  # the listing before -w
    assert watch_yaml.stdout is not None and watch_yaml.stdout.readline() == "[]\n"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": "from-file", "resources": {"gpus": 1},
                                        "run": {"argv": ["python", "-c", "print('hello from a file')"]}}))
    done = gpuctl("submit", "-f", str(job_file), "--wait")
    assert done.exit_code == 0, done.output
    job_id = done.stdout.strip()
    assert gpuctl.ok("logs", job_id[:8]).stdout == "hello from a file\n"
    described = gpuctl.json("describe", job_id)
    assert described["tenant"] == "acme" and described["state"] == "succeeded"  # type: ignore[index]
    assert [e["type"] for e in described["timeline"]][:2] == ["job.accepted", "job.placed"]  # type: ignore[index]

    out, errors = finish(events)
    first_events = [json.loads(line) for line in out.splitlines()]
    assert [e["type"] for e in first_events] == ["job.accepted", "job.placed"], errors
    assert {e["job_id"] for e in first_events} == {job_id}
    watched = json.loads(watch.stdout.readline())
    watch.terminate()
    assert (watched["id"], watched["state"]) == (job_id, "succeeded")
    assert watch_yaml.stdout.readline() == "---\n"  # -o yaml -w: a YAML document per change, not JSON
    document = lines_until(watch_yaml, "state: ")
    watch_yaml.terminate()
    assert f"id: {job_id}" in document and "state: succeeded" in document and "{" not in document
    ended = gpuctl("cancel", job_id)  # the API's 409, said as such
    assert ended.exit_code == 1 and "has already ended (succeeded): nothing to cancel" in ended.stderr
    recent = [json.loads(line) for line in gpuctl.ok("events", "--json").stdout.splitlines()]
    assert ("job.accepted", job_id) in {(e["type"], e.get("job_id")) for e in recent}  # oldest first, like kubectl
    listing = gpuctl.ok("jobs").stdout
    assert not {chr(c) for c in range(0x2500, 0x2580)} & set(listing)  # piped: no box-drawing characters
    refused = gpuctl("submit", "--wait", "--", "bash", "-c", "true")  # a command the allow-list refuses
    assert refused.exit_code == 1 and "'bash' is not allowed" in refused.stderr.splitlines()[-1], refused.stderr

    rejected = gpuctl("submit", "--gpus", "20", "--wait", "--", "python", "-c", "pass")
    assert rejected.exit_code == 1 and "can never fit" in rejected.stderr
    assert rejected.stderr.splitlines()[-1].startswith(f"gpuctl: job {rejected.stdout.strip()} rejected: ")
    too_big = gpuctl.json("describe", rejected.stdout.strip())
    assert too_big["spec"]["resources"]["gpus"] == 20 and "20 GPUs" in too_big["reason"]  # type: ignore[index]
    assert gpuctl("submit", "--tenant", "research", "--", "python", "-c", "pass").exit_code == 1  # 403
    container = gpuctl.ok("submit", "--image", f"registry.example/train@sha256:{'a' * 64}", "--", "train")
    assert gpuctl.json("describe", container.stdout.strip())["spec"]["run"]["runtime"] == "container"  # type: ignore[index]

    listed = gpuctl.json("jobs")
    assert {j["tenant"] for j in listed} == {"acme"} and job_id in {j["id"] for j in listed}  # type: ignore[union-attr,index]
    assert yaml.safe_load(gpuctl.ok("jobs", "-o", "yaml").stdout)[0]["tenant"] == "acme"
    table = gpuctl.ok("jobs", "--no-headers", "-o", "wide").stdout
    assert job_id in table and "full id" not in table  # the wide column, and no header line
    assert max(len(line) for line in table.splitlines()) > 80  # piped: never cut to 80 columns

    # follow a running job's log to its end; cancel a long one: only its own team may
    running = gpuctl.ok("submit", "--gpus", "1", "--", "python", "-c", PRINT_AND_WAIT, "2").stdout.strip()
    out, errors = finish(gpuctl.spawn("logs", "-f", running))
    assert out == "first\nlast\n", errors
    assert gpuctl.ok("logs", running, "--tail", "1").stdout == "last\n"
    assert gpuctl.ok("logs", running, "--tail", "5").stdout == "first\nlast\n"
    assert gpuctl.ok("logs", running, "--since", "10m").stdout == "first\nlast\n"  # times from the node's index
    assert gpuctl.ok("logs", running, "--since", "2999-01-01T00:00").stdout == ""
    stamped = gpuctl.ok("logs", running, "--timestamps", "--tail", "1").stdout
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z last\n", stamped), stamped
    bad_since = gpuctl("logs", running, "--since", "yesterday")
    assert bad_since.exit_code == 2 and "since" in bad_since.stderr
    long = gpuctl.ok("submit", "--gpus", "1", "--", "python", "-c", PRINT_AND_WAIT, "600").stdout.strip()
    gpuctl.ok("config", "set-context", "research", "--server", live_api.url, "--token", TOKENS["research-team"])
    assert long not in {j["id"] for j in gpuctl.json("jobs")}  # type: ignore[union-attr,index]
    assert gpuctl("cancel", long).exit_code == 1  # another team's job
    gpuctl.ok("config", "use-context", "acme")
    gpuctl.ok("cancel", long)
    assert gpuctl("submit", "--wait", "--timeout", "0", "--", "python", "-c", "pass").exit_code == 1
    state = ""
    for _ in range(300):
        state = gpuctl.json("describe", long)["state"]  # type: ignore[index]
        if state == "cancelled":
            break
        __import__("time").sleep(0.2)
    assert state == "cancelled"

    assert [q["tier"] for q in gpuctl.json("queues")] == ["training", "inference", "batch", "interactive"]  # type: ignore[index]
    assert [t["tenant"] for t in gpuctl.json("tenants")] == ["acme"]  # type: ignore[index]
    assert gpuctl.json("config", "current-context") == {"current-context": "acme"}
    frame = gpuctl.ok("top", "--once").stdout
    assert "fleet" in frame and "node-1" in frame and "top jobs by GPU-hours" in frame
    piped = gpuctl.spawn("top", "--interval", "0.2")  # not a terminal: a whole frame per refresh, as top -b
    assert piped.stdout is not None
    assert "fleet" in lines_until(piped, "top jobs by GPU-hours")
    piped.terminate()
    assert uuid.UUID(job_id)


@pytest.mark.parametrize("args", [["report", "--dsn", "postgresql://postgres@127.0.0.1:9/x"],
                                  ["dlq", "list", "--amqp-url", "amqp://guest:guest@127.0.0.1:9/"]])
def test_operator_commands_report_an_unreachable_server_in_one_line(args: list[str]) -> None:
    import sys

    done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert [line for line in done.stderr.splitlines() if line.startswith("gpuctl:")] == done.stderr.splitlines()[-1:]
    assert "Traceback" not in done.stderr and "cannot reach a server" in done.stderr


def wait_for(what: str, check: object, timeout_s: float = 90.0) -> object:
    """Poll ``check()`` until it answers something truthy; fails naming ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        answer = check()  # type: ignore[operator]
        if answer:
            return answer
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        time.sleep(0.3)


def test_report_and_dead_letters_come_through_the_api(gpuctl: Gpuctl, live_api: LiveApi, tmp_path: Path) -> None:
    for name, token in (("acme", "acme-team"), ("research", "research-team"), ("ops", "ops")):
        gpuctl.ok("config", "set-context", name, "--server", live_api.url, "--token", TOKENS[token], "--no-use")
    gpuctl.ok("config", "use-context", "research")
    theirs = gpuctl.ok("submit", "--name", "research-report-job", "--gpus", "1", "--wait", "--", "python", "-c",
                       "import time; time.sleep(8)").stdout.strip()
    gpuctl.ok("config", "use-context", "acme")
    mine = gpuctl.ok("submit", "--name", "acme-report-job", "--gpus", "1", "--wait", "--", "python", "-c",
                     "import time; time.sleep(8)").stdout.strip()

    gpuctl.ok("config", "use-context", "ops")  # the operator's report lists both once telemetry has their samples
    everything = wait_for("both jobs in the operator's report", lambda: (lambda r: r if {theirs, mine} <= {
        j["job_id"] for j in r["jobs"]} else None)(gpuctl.json("report", "--since", "1h")))
    assert {"acme", "research"} <= {t["tenant"] for t in everything["tenants"]}  # type: ignore[index]
    assert everything["tenants_shown"] is None and everything["fleet_series"]  # type: ignore[index]
    assert gpuctl.json("dlq", "list") == []  # nothing dead-lettered in this stack
    assert gpuctl.json("dlq", "list", "--queue", "scheduler", "--limit", "5") == []
    replayed = gpuctl.json("dlq", "replay", "--queue", "scheduler")  # the operator's replay, through the API
    assert (replayed["queue"], replayed["replayed"], replayed["messages"]) == ("scheduler", 0, [])  # type: ignore[index]

    gpuctl.ok("config", "use-context", "acme")
    report = gpuctl.ok("report", "--since", "1h", "--json")
    own = json.loads(report.stdout)
    assert [j["job_id"] for j in own["jobs"] if j["name"] == "acme-report-job"] == [mine]
    assert theirs not in report.stdout and "research" not in report.stdout  # another team's job is not shown
    assert own["tenants_shown"] == ["acme"] and [t["tenant"] for t in own["tenants"]] == ["acme"]
    table = gpuctl.ok("report", "--since", "1h", "--out", str(tmp_path / "review")).stdout
    assert "acme-report-job" in table and "Conclusions" in table
    assert (tmp_path / "review" / "utilisation.png").stat().st_size > 0 and (tmp_path / "review" / "report.html").exists()
    csv_rows = gpuctl.ok("report", "--since", "1h", "-o", "csv").stdout.splitlines()
    assert csv_rows[0].startswith("job_id,name,tenant") and not any(theirs in row for row in csv_rows)
    assert gpuctl("report", "--tenant", "research", "--json").exit_code == 1  # 403: not its tenant
    assert gpuctl("report", "--since", "a week").exit_code == 2

    for args in (["dlq", "list", "--json"], ["dlq", "replay", "--queue", "scheduler", "--json"]):
        refused = gpuctl(*args)
        assert refused.exit_code == 1 and "not an operator" in refused.stderr and refused.stderr.count("\n") == 1

    down = gpuctl("--server", "http://127.0.0.1:9", "report", "--json")
    assert down.exit_code == 1 and "cannot reach the gpuorch API" in down.stderr and down.stderr.count("\n") == 1
    assert gpuctl("--server", "http://127.0.0.1:9", "dlq", "list").exit_code == 1
    for args in (["report", "--help"], ["dlq", "list", "--help"], ["dlq", "replay", "--help"]):
        assert "decision 31" in " ".join(gpuctl.ok(*args).stdout.split())


def test_mig_plan_shows_the_schedulers_plan_through_the_api(gpuctl: Gpuctl, live_api: LiveApi) -> None:
    for name, token in (("acme", "acme-team"), ("ops", "ops")):
        gpuctl.ok("config", "set-context", name, "--server", live_api.url, "--token", TOKENS[token], "--no-use")
    gpuctl.ok("config", "use-context", "acme")
    deadline = time.monotonic() + 90
    while (idle := gpuctl.json("mig", "plan"))["mode"] != "advise":  # type: ignore[index]
        assert time.monotonic() < deadline, f"the scheduler's mode is not shown before anything needs MIG: {idle}"
        time.sleep(0.5)
    assert idle["proposals"] == [] and idle["updated_at"]  # type: ignore[index]
    assert "mode advise" in gpuctl.ok("mig", "plan").stdout
    waiting = gpuctl.ok("submit", "--tier", "inference", "--mig", "1g.10gb", "--", "python", "-c", "pass")
    job_id = waiting.stdout.strip()
    while not (plan := gpuctl.json("mig", "plan"))["proposals"]:  # type: ignore[index]
        assert time.monotonic() < deadline, f"no MIG plan: {plan}"
        time.sleep(0.5)
    assert plan["mode"] == "advise" and plan["source"] == "scheduler"  # type: ignore[index]
    [proposal] = plan["proposals"]  # type: ignore[index]
    assert proposal["node_id"] == "node-1" and proposal["target"] and "1g.10gb" in proposal["reason"]
    assert proposal["enables"] == 1  # a team sees counts, not job ids
    gpuctl.ok("config", "use-context", "ops")
    assert job_id in gpuctl.json("mig", "plan")["proposals"][0]["enables"]  # type: ignore[index]
    table = gpuctl.ok("mig", "plan").stdout
    assert "mode advise" in table and "node-1" in table
    while "gpuctl mig plan" not in (described := gpuctl.json("describe", job_id))["pending_reason"]:  # type: ignore[index,operator]
        assert time.monotonic() < deadline, f"the pending reason does not point at the plan: {described}"
        time.sleep(0.5)
    assert described["state"] == "queued"  # type: ignore[index]  # advise changes nothing
    assert "would repartition node-1 GPU" in described["pending_reason"]  # type: ignore[index,operator]
    gpuctl.ok("cancel", job_id)


def test_share_and_reservations_through_the_api(gpuctl: Gpuctl, live_api: LiveApi) -> None:
    for name, token in (("acme", "acme-team"), ("ops", "ops")):
        gpuctl.ok("config", "set-context", name, "--server", live_api.url, "--token", TOKENS[token], "--no-use")
    gpuctl.ok("config", "use-context", "acme")
    refused = gpuctl("reserve", "create", "--gpus", "1", "--start", "now+1h", "--duration", "1h", "--tenant", "acme")
    assert refused.exit_code == 1 and "not an operator" in refused.stderr
    share = wait_for("the scheduler's fair share row", lambda: (lambda d: d if d.get("half_life_s") else None)(
        gpuctl.json("share")))
    assert share["half_life_s"] == 7 * 86400 and all(t["tenant"] == "acme" for t in share["tenants"])  # type: ignore[index]
    gpuctl.ok("config", "use-context", "ops")
    made = gpuctl.json("reserve", "create", "--gpus", "1", "--start", "now+1h", "--duration", "2h", "--tenant", "acme")
    assert made["state"] == "pending" and len(made["nodes"]) == 1, made  # type: ignore[index,arg-type]
    nowhere = gpuctl("reserve", "create", "--gpus", "1", "--start", "now+1h", "--duration", "1h", "--tenant", "acme",
                     "--nodes", "no-such-node", "--json")  # refused by the scheduler: the document, then one line
    assert nowhere.exit_code == 1 and json.loads(nowhere.stdout)["state"] == "refused", nowhere.output
    assert nowhere.stderr.startswith("gpuctl: reservation ") and "unknown nodes: no-such-node" in nowhere.stderr
    gpuctl.ok("config", "use-context", "acme")
    [mine] = gpuctl.json("reserve", "list")  # type: ignore[misc]
    assert mine["reservation_id"] == made["reservation_id"]  # type: ignore[index]
    gpuctl.ok("config", "use-context", "ops")
    gpuctl.ok("reserve", "delete", str(made["reservation_id"])[:8])  # type: ignore[index]
    wait_for("the deletion", lambda: gpuctl.json("reserve", "show", str(made["reservation_id"]))["state"]  # type: ignore[index]
             == "deleted")
