"""Hostile text and numbers: every string refuses control characters, every number is bounded and finite, names
match a safe pattern, and ``output_tail_text`` makes any output fit a free-text field."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from gpuorch_contracts import (
    AlertRaised,
    GpuInfo,
    JobFailed,
    JobSpec,
    NodeHeartbeat,
    NodeInventory,
    ProcessRun,
    SubmitJob,
    decode,
    encode,
    output_tail_text,
    reason_text,
    strip_terminal_controls,
)
from gpuorch_contracts.schemas import message_schemas
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

SPEC = JobSpec(run=ProcessRun(argv=["python", "-c", "print(42)"]))
REFUSED_EVERYWHERE = ["\x00", "\x01", "\x1b", "\r", "\x7f", "\x85", "\x9b", "\x9d", "\ud800", "\udfff"]


def _submit_body(**spec_changes: Any) -> dict[str, Any]:
    raw = json.loads(encode(SubmitJob(spec=SPEC)))
    for dotted, value in spec_changes.items():
        node = raw["spec"]
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    return raw


@pytest.mark.parametrize("bad", REFUSED_EVERYWHERE, ids=[f"U+{ord(c):04X}" for c in REFUSED_EVERYWHERE])
@pytest.mark.parametrize("field", ["name", "tenant", "run__argv", "run__env", "run__workdir", "labels"])
def test_a_control_character_in_any_submitted_string_is_refused(field: str, bad: str) -> None:
    value: Any = f"a{bad}b"
    if field == "run__argv":
        value = ["python", value]
    elif field == "run__env":
        value = {"KEY": value}
    elif field == "labels":
        value = {"team": value}
    body = json.dumps(_submit_body(**{field: value}))
    with pytest.raises(ValidationError):
        decode(body)


def test_a_json_escaped_nul_or_surrogate_is_refused_like_a_raw_one() -> None:
    body = encode(SubmitJob(spec=SPEC)).decode().replace('"print(42)"', '"print(42)\\u0000"')
    with pytest.raises(ValidationError, match="U\\+0000 at position 9"):
        decode(body)
    body = encode(SubmitJob(spec=SPEC)).decode().replace('"print(42)"', '"\\ud83d"')
    with pytest.raises(ValidationError, match=r"string_unicode|U\+D83D"):
        decode(body)


def test_free_text_keeps_tab_and_newline_and_any_printable_character() -> None:
    reason = "Traceback:\n\tline 1 — ünïcode, emoji 🚀, [markup] & <html>"
    failed = JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason=reason)
    assert decode(encode(failed)) == failed
    run = ProcessRun(argv=["python", "-c", "import sys\nprint(sys.argv)"], env={"CERT": "-----\nabc\n-----"})
    assert run.argv[2].count("\n") == 1


@pytest.mark.parametrize("bad", ["\x00", "\x1b]0;pwned\x07", "\r", "\x9b31m"])
def test_free_text_refuses_nul_escape_sequences_and_carriage_returns(bad: str) -> None:
    with pytest.raises(ValidationError, match="control character"):
        JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason=f"exited 1: {bad}")


@pytest.mark.parametrize("bad", ["\n", "\t", "\x00", "\x1b"])
def test_one_line_fields_refuse_tab_and_newline_too(bad: str) -> None:
    with pytest.raises(ValidationError, match="control character"):
        NodeInventory(node_id="n1", hostname=f"host{bad}", cpu_milli=1000, memory_mib=1024)
    with pytest.raises(ValidationError, match="control character"):
        GpuInfo(uuid=f"GPU-1{bad}", index=0, model="A100", memory_total_mib=1)


@pytest.mark.parametrize("name", ["[/]", "a b", "-leading-dash", "x;rm -rf /", "$(id)", "é", "", "a" * 129])
def test_job_names_match_a_safe_pattern(name: str) -> None:
    with pytest.raises(ValidationError):
        JobSpec(run=ProcessRun(argv=["x"]), name=name)


@pytest.mark.parametrize("tenant", ["Research", "team.a", "team/a", "a*", "#", "", "a" * 64])
def test_tenants_are_lower_case_words(tenant: str) -> None:
    with pytest.raises(ValidationError):
        JobSpec(run=ProcessRun(argv=["x"]), tenant=tenant)


def test_safe_names_and_tenants_pass() -> None:
    spec = JobSpec(run=ProcessRun(argv=["x"]), name="llama-7b_ft.v2:run@3+1/2", tenant="team-a_1")
    assert spec.tenant == "team-a_1"


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_nan_and_infinity_are_refused(token: str) -> None:
    body = encode(SubmitJob(spec=SPEC)).decode().replace('"grace_s":30.0', f'"grace_s":{token}')
    assert token in body
    with pytest.raises(ValidationError):
        decode(body)
    raised = json.loads(encode(AlertRaised(alert_id=uuid.uuid4(), kind="idle", node_id="n1", explanation="idle",
                                           evidence={"mean_util_pct": 1.0})))
    with pytest.raises(ValidationError):
        decode(json.dumps(raised).replace('"mean_util_pct": 1.0', f'"mean_util_pct": {token}'))


@pytest.mark.parametrize(("field", "value"), [
    ("sequence", 2**53), ("gpus", [{"index": 0, "memory_used_mib": 2**31}]),
    ("gpus", [{"index": 0, "temperature_c": 1e6}]), ("gpus", [{"index": 0, "power_w": 1e300}]),
])
def test_absurd_numbers_are_refused(field: str, value: Any) -> None:
    raw = json.loads(encode(NodeHeartbeat(node_id="n1", inventory_hash="h", sequence=1)))
    raw[field] = value
    with pytest.raises(ValidationError):
        decode(json.dumps(raw))


def test_absurd_exit_codes_and_durations_are_refused() -> None:
    with pytest.raises(ValidationError):
        JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason="x", exit_code=2**40)
    with pytest.raises(ValidationError):
        JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason="x", duration_s=1e12)


def _walk(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key not in ("default", "const", "enum"):
                yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def test_every_string_of_every_message_is_constrained_and_every_number_bounded() -> None:
    """The schemas are generated from the models, so this covers fields added later too."""
    unconstrained, unbounded = [], []
    for name, schema in message_schemas().items():
        for path, node in _walk(schema):
            kind = node.get("type")
            if kind == "string" and not ({"enum", "const", "format"} & node.keys()):
                pattern = node.get("pattern")
                if pattern is None or any(re.search(pattern, f"a{c}b") for c in ("\x00", "\x1b", "\x9b", "\r")):
                    unconstrained.append(f"{name}{path}")
                if "maxLength" not in node:
                    unconstrained.append(f"{name}{path} (no maxLength)")
            if kind in ("integer", "number"):
                has_low = "minimum" in node or "exclusiveMinimum" in node
                has_high = "maximum" in node or "exclusiveMaximum" in node
                if not (has_low and has_high):
                    unbounded.append(f"{name}{path}")
            if kind == "array" and "maxItems" not in node:
                unconstrained.append(f"{name}{path} (array without maxItems)")
            if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
                unconstrained.append(f"{name}{path} (map without maxProperties)")
    assert unconstrained == []
    assert unbounded == []


# -- output_tail_text ----------------------------------------------------------------------------------------------

HOSTILE_OUTPUT = (
    "\x1b[31mred\x1b[0m \x1b]8;;http://evil.example\x1b\\link\x1b]8;;\x1b\\ "
    "\x1b]52;c;cm0gLXJmIC8=\x07clip \x1b]0;title\x07\x9b2J\x00nul\x85\u202eevil\u202c\n"
    "progress 10%\rprogress 50%\rprogress 100%\r\nlast line\t(tab)\n"
)


def test_output_tail_text_strips_escape_sequences_and_controls() -> None:
    text = output_tail_text(HOSTILE_OUTPUT)
    assert text == "red link clip nulevil\nprogress 100%\nlast line\t(tab)"
    assert JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason=text).reason == text


def test_output_tail_text_keeps_the_end_within_the_length() -> None:
    output = "".join(f"line {i}\n" for i in range(1000)).encode()
    text = output_tail_text(output, max_chars=100)
    assert text == "…" + "\n".join(f"line {i}" for i in range(989, 1000))
    assert len(text) <= 100


def test_reason_text_keeps_the_head_of_a_validation_error() -> None:
    try:
        decode(encode(SubmitJob(spec=SPEC)).decode().replace('"print(42)"', '"\\u001b]0;x\\u0007' + "y" * 5000 + '"'))
    except ValidationError as exc:
        text = reason_text(str(exc), max_chars=60)
    assert text.startswith("1 validation error for SubmitJob") and text.endswith("…") and len(text) <= 60
    assert JobFailed(job_id=uuid.uuid4(), cause="refused", reason=reason_text("\x1b[2Jboom\x00" * 400)).reason


def test_output_tail_text_decodes_broken_utf8() -> None:
    assert output_tail_text(b"ok \xff\xfe done\x00") == "ok \ufffd\ufffd done"


@given(st.one_of(st.text(), st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")), st.binary()),
       st.integers(min_value=1, max_value=1024))
def test_any_output_fits_a_reason(output: str | bytes, max_chars: int) -> None:
    for text in (output_tail_text(output, max_chars=max_chars), reason_text(output, max_chars=max_chars)):
        assert len(text) <= max_chars
        JobFailed(job_id=uuid.uuid4(), cause="nonzero_exit", reason=text)
        assert strip_terminal_controls(text) == text
