"""The AsyncAPI 3.0 document: its shape here, and the official parser's verdict (``deploy/asyncapi-check``).

The parser test runs wherever ``make asyncapi-check`` (or ``.ci/run``) installed the parser; CI always does, so
there it runs and a parser error fails the build.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpuorch_contracts import MESSAGE_TYPES, SUBMIT_EXCHANGE
from gpuorch_contracts.schemas import asyncapi_document

ROOT = Path(__file__).parents[3]
CHECKER = ROOT / "deploy" / "asyncapi-check"
DOCUMENT = ROOT / "libs" / "contracts" / "schemas" / "asyncapi.json"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if isinstance(node.get("$ref"), str) else [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


def _resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} points outside the document"
    node: Any = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_the_document_is_asyncapi_3_and_self_contained() -> None:
    document = asyncapi_document()
    assert document["asyncapi"] == "3.0.0"
    for ref in _refs(document):
        _resolve(document, ref)  # raises KeyError when dangling
    assert not {"$defs", "prefixItems"} & _keys(document["components"]["schemas"])
    discriminators = [k for k in _keys(document) if k == "discriminator"]
    assert discriminators == []
    assert len(document["components"]["messages"]) == len(MESSAGE_TYPES)


def test_submissions_are_received_on_the_submit_exchange() -> None:
    document = asyncapi_document()
    operation = document["operations"]["receive-job.submit"]
    assert operation["action"] == "receive"
    channel = _resolve(document, operation["channel"]["$ref"])
    assert channel["address"] == "job.submit"
    assert channel["bindings"]["amqp"]["exchange"]["name"] == SUBMIT_EXCHANGE
    payload = _resolve(document, _resolve(document, operation["messages"][0]["$ref"])["$ref"])["payload"]
    assert _resolve(document, payload["$ref"])["title"] == "SubmitJob"


def _run_parser(path: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("node") is None or not (CHECKER / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.skip("the AsyncAPI parser is not installed: run `make asyncapi-check` (CI does)")
    return subprocess.run(["node", str(CHECKER / "check.mjs"), str(path)], capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_official_parser_accepts_the_checked_in_document() -> None:
    result = _run_parser(DOCUMENT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 error(s), 0 warning(s)" in result.stdout


def test_the_parser_check_fails_on_pydantics_discriminator_object(tmp_path: Path) -> None:
    """What the 2.6 document did: the check must turn such errors into a failing exit status."""
    document = copy.deepcopy(asyncapi_document())
    run = document["components"]["schemas"]["JobSpec"]["properties"]["run"]
    run["discriminator"] = {"propertyName": "runtime", "mapping": {"process": "#/components/schemas/ProcessRun"}}
    broken = tmp_path / "asyncapi.json"
    broken.write_text(json.dumps(document))
    result = _run_parser(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "discriminator" in result.stdout and " 0 error(s)" not in result.stdout
