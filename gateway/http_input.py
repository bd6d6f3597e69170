"""What a client sends the admin HTTP API, checked before a handler acts on it.

How it works: the OpenAPI document (``gateway/openapi.py``) is the contract and the check
at once. ``RequestContract`` takes each operation's request body schema and query
parameters from it, keyed by the route's path and method, so a handler asks for its
body or a query integer and gets one that matches what the document says, or the client
gets a 400 ``invalid-argument`` naming the field. Nothing is left to fail deeper in,
where a wrong type or range would be a TypeError, an OverflowError in the database
driver or text the database cannot store (a 500, or a 503 that blames the storage).

Every JSON body is held to what keygate can store before its schema is checked: JSON
proper (``NaN`` and ``Infinity`` are refused; a number too large for a float, such as
``1e400``, too), integers in the signed 64-bit range, and text that is valid Unicode (a
lone surrogate such as ``"\\ud800"`` cannot be encoded as UTF-8), in values and in
field names. The schema part understands what the document uses: ``type`` (one or a
list), ``enum``, ``minimum``, ``exclusiveMinimum``, ``maximum``, ``properties``,
``required``, ``additionalProperties`` (``false`` refuses unknown fields, a schema checks
their values) and ``items``.

What a schema cannot say is checked where the knowledge is: a partition below the
queue's partition count (the handler), queue settings' ranges (``QueueConfig``), message
properties (``core.ingress``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from core.errors import InvalidArgument

INT64_MAX: Final = 2**63 - 1

_ARTICLES: Final = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "null": "null",
    "object": "an object",
    "array": "an array",
}


def _is(value: object, kind: str) -> bool:
    match kind:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "null":
            return value is None
        case "object":
            return isinstance(value, dict)
        case "array":
            return isinstance(value, list)
    raise ValueError(f"unknown JSON type {kind!r} in the OpenAPI document")


def _field(where: str, name: object) -> str:
    return f"{where}.{name}" if where else str(name)


def _storable(value: object, where: str) -> None:
    """Refuse what no field can take: text that is not valid Unicode, numbers out of range.
    ``where`` names the field ("" for the body itself)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise InvalidArgument(f"{where} is not valid Unicode") from None
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{where} must be a finite number")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise InvalidArgument(f"{where} is out of range (64-bit integers)")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _storable(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for name, item in value.items():
            _storable(name, f"a field name in {where}" if where else "a field name")
            _storable(item, _field(where, name))


def _range(where: str, schema: Mapping[str, Any]) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        return f"{where} must be greater than {schema['exclusiveMinimum']}"
    if low is not None and high is not None:
        return f"{where} must be between {low} and {high}"
    return (
        f"{where} must be at least {low}" if low is not None else f"{where} must be at most {high}"
    )


def check(value: object, schema: Mapping[str, Any], where: str) -> None:
    """InvalidArgument naming ``where`` unless ``value`` matches ``schema``."""
    kinds = schema.get("type")
    if kinds is not None:
        allowed = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is(value, kind) for kind in allowed):
            raise InvalidArgument(f"{where} must be {' or '.join(_ARTICLES[k] for k in allowed)}")
    if "enum" in schema and value not in schema["enum"]:
        raise InvalidArgument(f"{where} must be one of: {', '.join(map(str, schema['enum']))}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        above = schema.get("exclusiveMinimum")
        if (
            (low is not None and value < low)
            or (high is not None and value > high)
            or (above is not None and value <= above)
        ):
            raise InvalidArgument(_range(where, schema))
    if isinstance(value, dict):
        _check_object(value, schema, where)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check(item, schema["items"], f"{where}[{i}]")


def _check_object(value: dict[str, Any], schema: Mapping[str, Any], where: str) -> None:
    missing = [name for name in schema.get("required", ()) if name not in value]
    if missing:
        raise InvalidArgument(f"{_field(where, missing[0])} is required")
    properties = schema.get("properties", {})
    others = schema.get("additionalProperties", True)
    unknown = sorted(name for name in value if name not in properties)
    if unknown and others is False:
        raise InvalidArgument(
            f"unknown fields{' in ' + where if where else ''}: {', '.join(unknown)}"
        )
    for name, item in value.items():
        item_schema = properties.get(name, others if isinstance(others, dict) else {})
        check(item, item_schema, _field(where, name))


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class RequestContract:
    """The request bodies and query parameters of every operation in the document."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self._bodies: dict[tuple[str, str], Mapping[str, Any]] = {}
        self._queries: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                if method == "parameters":
                    continue
                at = (path, method.upper())
                content = operation.get("requestBody", {}).get("content", {})
                if "application/json" in content:
                    self._bodies[at] = content["application/json"]["schema"]
                self._queries[at] = {
                    p["name"]: p["schema"]
                    for p in operation.get("parameters", ())
                    if p["in"] == "query"
                }

    @staticmethod
    def _route(request: web.Request) -> tuple[str, str]:
        return request.match_info.route.resource.canonical, request.method  # type: ignore[union-attr]

    async def body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, checked against its operation's schema."""
        try:
            body = json.loads(await request.text(), parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        _storable(body, "")
        check(body, self._bodies[self._route(request)], "")
        return body

    def query_int(self, request: web.Request, name: str) -> int | None:
        """Query parameter ``name`` as an integer in its documented range; its documented
        default (or None) when absent."""
        schema = self._queries[self._route(request)][name]
        raw = request.query.get(name)
        if raw is None:
            return schema.get("default")
        try:
            value = int(raw)
        except ValueError:
            raise InvalidArgument(f"{name} must be an integer") from None
        check(value, schema, name)
        return value


__all__ = ["INT64_MAX", "RequestContract", "check"]
