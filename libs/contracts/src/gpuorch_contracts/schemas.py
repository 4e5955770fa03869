"""JSON Schema for every message and an AsyncAPI 3.0 document, generated from the models.

The generated files are checked in under ``libs/contracts/schemas/``; a test fails when they drift from the
models, so a contract change is always visible in review. Regenerate with ``gpuctl schema export``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuorch_contracts.envelope import MAX_MESSAGE_BYTES
from gpuorch_contracts.routing import (
    COMMAND_TYPES,
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    MESSAGE_TYPES,
    SUBMIT_EXCHANGE,
    SUBMIT_TYPES,
    TENANT_ROUTED_TYPES,
)


def message_schemas() -> dict[str, dict[str, Any]]:
    return {name: cls.model_json_schema(mode="validation") for name, cls in sorted(MESSAGE_TYPES.items())}


ASYNCAPI_VERSION = "3.0.0"
AMQP_BINDING_VERSION = "0.3.0"


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every message: one channel per exchange and routing key, one operation per
    channel, every model a reusable schema under ``components.schemas``.

    The document describes the gpuorch system as one application: it *receives* ``job.submit``/``job.cancel`` on
    ``gpuorch.submit`` and *sends* events (``gpuorch.events``) and per-node commands (``gpuorch.commands``).
    Schemas are the models' JSON Schemas rewritten into AsyncAPI's schema dialect (a superset of JSON Schema
    draft-07): ``$defs`` become ``components.schemas`` entries, ``prefixItems`` (tuples) become draft-07 ``items``
    arrays, and pydantic's OpenAPI-style ``discriminator`` object is dropped (each ``oneOf`` branch already pins the
    discriminating property with ``const``). The official parser (``@asyncapi/parser``) must accept it with no
    error: ``deploy/asyncapi-check`` runs it in CI.
    """
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for name, cls in sorted(MESSAGE_TYPES.items()):
        model = cls.__name__
        _add_component_schemas(schemas, model, cls.model_json_schema(mode="validation", ref_template=_REF))
        messages[model] = {
            "name": name,
            "title": model,
            "summary": _first_line(cls.__doc__) or f"{name} message",
            "contentType": "application/json",
            "payload": {"$ref": f"#/components/schemas/{model}"},
            "bindings": {"amqp": {"messageType": name, "bindingVersion": AMQP_BINDING_VERSION}},
        }
        channel_id = name
        if name in SUBMIT_TYPES:
            exchange, address, action = SUBMIT_EXCHANGE, name, "receive"
        elif name in COMMAND_TYPES:
            exchange, address, action = COMMANDS_EXCHANGE, f"node.{{node_id}}.{name}", "send"
        elif name in TENANT_ROUTED_TYPES:
            exchange, address, action = EVENTS_EXCHANGE, f"{name}.{{tenant}}", "send"
        else:
            exchange, address, action = EVENTS_EXCHANGE, name, "send"
        channel: dict[str, Any] = {
            "address": address,
            "title": f"{exchange} / {address}",
            "description": f"Routing key `{address}` on the topic exchange `{exchange}`.",
            "messages": {model: {"$ref": f"#/components/messages/{model}"}},
            "bindings": {"amqp": {
                "is": "routingKey",
                "exchange": {"name": exchange, "type": "topic", "durable": True, "autoDelete": False},
                "bindingVersion": AMQP_BINDING_VERSION,
            }},
        }
        if name in COMMAND_TYPES:
            channel["parameters"] = {"node_id": {"description": "the node the command is for"}}
        if name in TENANT_ROUTED_TYPES:
            channel["parameters"] = {"tenant": {"description": (
                "the job's verified tenant; a submitter binds job.*.<its tenant> (an event without a tenant has "
                "the bare key)")}}
        channels[channel_id] = channel
        operations[f"{action}-{channel_id}"] = {
            "action": action,
            "title": f"{action} {name}",
            "summary": (f"Other systems publish {model} here; gpuorch consumes it." if action == "receive"
                        else f"gpuorch publishes {model} here."),
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{model}"}],
        }
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "gpuorch messages", "version": "1",
            "description": (
                "Other systems submit work by publishing SubmitJob (JSON, content-type application/json) to the "
                "topic exchange gpuorch.submit with routing key job.submit.<tenant> (the tenant's own lane: one "
                "tenant's backlog does not delay another's) or job.submit (the shared lane), with publisher "
                "confirms and mandatory; cancels likewise (job.cancel.<tenant> or job.cancel). "
                "Unknown fields are refused; invalid messages are dead-lettered with the reason. Answers arrive "
                "as job.accepted / job.rejected events on gpuorch.events with routing keys <type>.<tenant> "
                "(bind job.*.<your tenant>). Every publisher sets the AMQP user_id property to its broker user. Bodies are at most "
                f"{MAX_MESSAGE_BYTES} bytes; strings hold no control characters (free text allows TAB and LF); "
                "numbers are finite and bounded."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "rabbitmq": {
                "host": "localhost:5672", "protocol": "amqp", "protocolVersion": "0-9-1", "pathname": "/gpuorch",
                "description": "RabbitMQ (vhost gpuorch); each publisher authenticates as its own user.",
            },
        },
        "channels": channels,
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
    }


_REF = "#/components/schemas/{model}"


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ").strip()


def _add_component_schemas(schemas: dict[str, Any], model: str, schema: dict[str, Any]) -> None:
    """Hoist ``schema`` and its ``$defs`` into ``schemas``; the same name must always mean the same schema."""
    definitions = {model: schema, **schema.pop("$defs", {})}
    for key, definition in definitions.items():
        converted = _to_asyncapi_schema(definition)
        if schemas.setdefault(key, converted) != converted:
            raise ValueError(f"two different models are both named {key}")


def _to_asyncapi_schema(node: Any) -> Any:
    """Rewrite pydantic's JSON Schema (2020-12) into the AsyncAPI schema dialect (draft-07 based)."""
    if isinstance(node, list):
        return [_to_asyncapi_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "discriminator" and isinstance(value, dict):
            continue
        if key in ("default", "const", "enum", "examples"):
            out[key] = value
        elif key == "prefixItems":
            out["items"] = _to_asyncapi_schema(value)
            out["additionalItems"] = False
        elif key in ("properties", "patternProperties"):
            out[key] = {name: _to_asyncapi_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _to_asyncapi_schema(value)
    return out


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
