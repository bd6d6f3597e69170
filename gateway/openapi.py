"""The admin API's OpenAPI 3.1 document, served at ``/api/openapi.json``.

The server checks every request body and query parameter against this document
(``gateway/http_input.py``), so what it says a request may hold is what is accepted.
Queue settings come from the settings table (``core.settings``), so a new setting appears
here without a second list to keep. ``tests/integration/test_openapi.py`` checks
that every route the server has is documented (and nothing more), and runs schemathesis
against a live gateway with a small budget.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Final

from core.settings import QUEUE_SETTINGS
from gateway.http_input import INT64_MAX

_JSON_TYPES: Final = {int: "integer", float: "number", bool: "boolean", str: "string"}


def package_version() -> str:
    """keygate's installed version ("0+unknown" when run from a bare checkout)."""
    try:
        return metadata.version("keygate")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _queue_settings() -> dict[str, Any]:
    """JSON Schema of every queue setting, from the settings table."""
    out: dict[str, Any] = {"subscriptions": {"type": "array", "items": {"type": "string"}}}
    for setting in QUEUE_SETTINGS:
        kind = _JSON_TYPES[setting.kind]
        unit = f" ({setting.unit})" if setting.unit else ""
        out[setting.name] = {
            "type": [kind, "null"] if setting.optional else kind,
            "description": setting.help + unit,
        }
        if setting.minimum is not None:
            out[setting.name].update(minimum=setting.minimum, maximum=setting.maximum)
    return out


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ok(description: str, schema: dict[str, Any] | None = None, status: str = "200") -> Any:
    body: dict[str, Any] = {"description": description}
    if schema is not None:
        body["content"] = _json(schema)
    return {status: body}


# Most messages one browse call returns (the CLI pages through more).
BROWSE_LIMIT: Final = 1000

_ERROR: Final = {"$ref": "#/components/responses/Error"}
_OBJECT: Final = {"type": "object"}
_NAME: Final = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    errors = {code: _ERROR for code in ("400", "401", "403", "404", "409", "503")}
    return {"summary": summary, "responses": {**responses, **errors}, **extra}


def _query(
    name: str, description: str, default: int | None, low: int = 0, high: int = INT64_MAX
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": high}
    if default is not None:
        schema["default"] = default
    return {"name": name, "in": "query", "schema": schema, "description": description}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": _json(schema)}}


def openapi_document(version: str) -> dict[str, Any]:
    """The whole document; ``version`` is the package version."""
    settings = _queue_settings()
    queue = {"type": "object", "properties": {"name": {"type": "string"}, **settings}}
    new_queue = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string"}, "exist_ok": {"type": "boolean"}, **settings},
        "additionalProperties": False,
    }
    group = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "mode": {"enum": ["partitioned", "exclusive", "shared"]},
            "key_order": {"enum": ["partition", "strict"]},
            "start": {"enum": ["earliest", "latest"]},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "ack_timeout": {
                "type": ["number", "null"],
                "exclusiveMinimum": 0,
                "description": "seconds a delivery may stay unacked before it is redelivered",
            },
        },
        "additionalProperties": False,
    }
    message = {
        "type": "object",
        "properties": {
            "payload": {
                "type": "string",
                "description": "the payload as text, stored as UTF-8 (default empty); not "
                "with payload_b64",
            },
            "payload_b64": {"type": "string", "description": "the payload in base64 (binary)"},
            "key": {"type": ["string", "null"]},
            "properties": {"type": "object"},
            "ttl": {
                "type": ["number", "null"],
                "exclusiveMinimum": 0,
                "description": "seconds until it expires",
            },
            "delay": {
                "type": ["number", "null"],
                "minimum": 0,
                "description": "seconds before it may be delivered (scheduled delivery)",
            },
            "dedup_id": {"type": ["string", "null"]},
            "content_type": {"type": ["string", "null"]},
        },
        "additionalProperties": False,
    }
    receipt = {
        "type": "object",
        "properties": {
            "message_ids": {"type": "array", "items": {"type": "string"}},
            "queues": {"type": "array", "items": {"type": "string"}},
        },
    }
    queue_path = {"parameters": [_NAME]}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "keygate admin API",
            "version": version,
            "description": "Queues, groups, partitions and flows of a keygate gateway. "
            "Errors are JSON objects with a stable `error` code and a `message`. A request "
            "that does not match this document (a wrong JSON type, a number out of range, an "
            "unknown field, text that is not valid Unicode) is refused with 400 "
            "`invalid-argument` naming the field.",
        },
        "components": {
            "responses": {
                "Error": {
                    "description": "A keygate error",
                    "content": _json(
                        {
                            "type": "object",
                            "required": ["error", "message"],
                            "properties": {
                                "error": {"type": "string"},
                                "message": {"type": "string"},
                            },
                        }
                    ),
                }
            },
            "securitySchemes": {"basic": {"type": "http", "scheme": "basic"}},
        },
        "security": [{}, {"basic": []}],
        "paths": {
            "/": {"get": _op("The web console (HTML)", _ok("The console page"))},
            "/healthz": {"get": _op("Liveness", _ok("Alive", _OBJECT), security=[{}])},
            "/metrics": {"get": _op("Prometheus metrics (text format)", _ok("Metrics"))},
            "/api/openapi.json": {"get": _op("This document", _ok("OpenAPI 3.1", _OBJECT))},
            "/api/status": {
                "get": _op(
                    "The gateway: role, name, version, database and listeners' ports",
                    _ok("Status", _OBJECT),
                )
            },
            "/api/queues": {
                "get": _op(
                    "Every queue with its settings and stats",
                    _ok("Queues", {"type": "array", "items": queue}),
                ),
                "post": _op(
                    "Create a queue (admin); exist_ok checks an existing one",
                    _ok("Created", queue, "201"),
                    **_body(new_queue),
                ),
            },
            "/api/queues/{name}": {
                **queue_path,
                "get": _op("One queue, its settings and stats", _ok("The queue", queue)),
                "patch": _op(
                    "Alter settings (admin)",
                    _ok("The queue", queue),
                    **_body(
                        {"type": "object", "properties": settings, "additionalProperties": False}
                    ),
                ),
                "delete": _op("Delete the queue (admin)", _ok("Deleted", _OBJECT)),
            },
            "/api/queues/{name}/purge": {
                **queue_path,
                "post": _op("Drop every message (admin)", _ok("Purged", _OBJECT)),
            },
            "/api/queues/{name}/redrive": {
                **queue_path,
                "post": _op(
                    "Move dead letters back to their original queue, or to `to` (admin)",
                    _ok("How many moved, how many were left in place", _OBJECT),
                    **_body(
                        {
                            "type": "object",
                            "properties": {
                                "to": {"type": ["string", "null"]},
                                "key": {"type": ["string", "null"]},
                                "limit": {"type": ["integer", "null"], "minimum": 1},
                            },
                            "additionalProperties": False,
                        }
                    ),
                ),
            },
            "/api/queues/{name}/inspect": {
                **queue_path,
                "get": _op("Groups, partitions and flows", _ok("Inspection", _OBJECT)),
            },
            "/api/queues/{name}/groups": {
                **queue_path,
                "get": _op("The queue's consumer groups", _ok("Groups", {"type": "array"})),
                "post": _op("Create a group (admin)", _ok("Created", group, "201"), **_body(group)),
            },
            "/api/queues/{name}/groups/{group}": {
                "parameters": [
                    _NAME,
                    {"name": "group", "in": "path", "required": True, "schema": {"type": "string"}},
                ],
                "delete": _op("Delete a group and its progress (admin)", _ok("Deleted", _OBJECT)),
            },
            "/api/queues/{name}/groups/{group}/reset": {
                "parameters": [
                    _NAME,
                    {"name": "group", "in": "path", "required": True, "schema": {"type": "string"}},
                ],
                "post": _op(
                    "Replay or skip: move the group (admin; refused while consumers are bound "
                    "unless force)",
                    _ok("The committed seq per partition moved", _OBJECT),
                    **_body(
                        {
                            "type": "object",
                            "required": ["to"],
                            "properties": {
                                "to": {
                                    "type": "string",
                                    "description": "earliest, latest, seq:P=N,... or time:ISO8601",
                                },
                                "force": {"type": "boolean"},
                            },
                            "additionalProperties": False,
                        }
                    ),
                ),
            },
            "/api/queues/{name}/groups/{group}/keys/{key}/release": {
                "parameters": [
                    _NAME,
                    {"name": "group", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}},
                ],
                "post": _op(
                    "Let a key parked after a dead letter flow again (admin; on_dead_letter = "
                    "park_key): from its oldest held message, or with skip its messages "
                    "stored until now are dead-lettered first",
                    _ok("The partitions the key was parked in", _OBJECT),
                    **_body(
                        {
                            "type": "object",
                            "properties": {"skip": {"type": "boolean"}},
                            "additionalProperties": False,
                        }
                    ),
                ),
            },
            "/api/queues/{name}/messages": {
                **queue_path,
                "get": _op(
                    "Browse stored messages without consuming them (needs consume)",
                    _ok("Messages in (partition, seq) order", {"type": "array", "items": _OBJECT}),
                    parameters=[
                        _query("partition", "only this partition (0 to the queue's last)", None),
                        _query("from_seq", "first seq to show", 0),
                        _query("limit", "most messages", 100, 1, BROWSE_LIMIT),
                    ],
                ),
                "post": _op(
                    "Publish to the queue", _ok("Stored", receipt, "201"), **_body(message)
                ),
            },
            "/api/topics/{topic}/messages": {
                "parameters": [
                    {"name": "topic", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "post": _op(
                    "Publish to a topic ('/'-separated)",
                    _ok("Stored", receipt, "201"),
                    **_body(message),
                ),
            },
        },
    }


__all__ = ["openapi_document", "package_version"]
