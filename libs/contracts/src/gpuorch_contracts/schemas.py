"""JSON Schema for every message and an AsyncAPI 2.6 document, generated from the models.

The generated files are checked in under ``libs/contracts/schemas/``; a test fails when they drift from the
models, so a contract change is always visible in review. Regenerate with ``gpuctl schema export``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuorch_contracts.routing import (
    COMMAND_TYPES,
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    MESSAGE_TYPES,
    SUBMIT_EXCHANGE,
    SUBMIT_TYPES,
)


def message_schemas() -> dict[str, dict[str, Any]]:
    return {name: cls.model_json_schema(mode="validation") for name, cls in sorted(MESSAGE_TYPES.items())}


def asyncapi_document() -> dict[str, Any]:
    channels: dict[str, Any] = {}
    for name in sorted(MESSAGE_TYPES):
        if name in SUBMIT_TYPES:
            exchange, key = SUBMIT_EXCHANGE, name
        elif name in COMMAND_TYPES:
            exchange, key = COMMANDS_EXCHANGE, f"node.{{node_id}}.{name}"
        else:
            exchange, key = EVENTS_EXCHANGE, name
        operation = "publish" if name in SUBMIT_TYPES else "subscribe"
        channels[f"{exchange}/{key}"] = {
            "bindings": {"amqp": {"is": "routingKey", "exchange": {"name": exchange, "type": "topic",
                                                                   "durable": True}}},
            operation: {"message": {"$ref": f"#/components/messages/{name}"}},
        }
    return {
        "asyncapi": "2.6.0",
        "info": {
            "title": "gpuorch messages", "version": "1",
            "description": (
                "Other systems submit work by publishing SubmitJob (JSON, content-type application/json) to the "
                "topic exchange gpuorch.submit with routing key job.submit, with publisher confirms and mandatory. "
                "Unknown fields are refused; invalid messages are dead-lettered with the reason. Answers arrive "
                "as job.accepted / job.rejected events on gpuorch.events."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "components": {"messages": {
            name: {"name": name, "payload": {"$ref": f"{name}.schema.json"}} for name in sorted(MESSAGE_TYPES)
        }},
    }


def write_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in message_schemas().items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    path = directory / "asyncapi.json"
    path.write_text(json.dumps(asyncapi_document(), indent=2, sort_keys=True) + "\n")
    written.append(path)
    return written
