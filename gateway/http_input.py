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
field names. The schemas are checked by ``jsonschema`` (OpenAPI 3.1's schemas are JSON
Schema 2020-12), the most relevant violation reported with a fixed reason of ours that
names the field and never echoes the value.

What a schema cannot say is checked where the knowledge is: a partition below the
queue's partition count (the handler), queue settings' ranges (``QueueConfig``), message
properties (``core.ingress``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final, cast

from aiohttp import web
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

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


def _where(path: Sequence[object]) -> str:
    """A field's name as errors give it: ``tags.color``, ``items[2]``."""
    where = ""
    for step in path:
        where += f"[{step}]" if isinstance(step, int) else f"{'.' if where else ''}{step}"
    return where


def _reason(error: ValidationError) -> str:
    """The fixed reason for a schema violation, naming the field (never the value)."""
    where = _where(error.absolute_path)
    schema, kind = error.schema, error.validator
    if not isinstance(schema, Mapping):  # a boolean schema: ``false`` takes nothing
        return f"{where} is not allowed"
    match kind:
        case "type":
            kinds = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
            return f"{where} must be {' or '.join(_ARTICLES[k] for k in kinds)}"
        case "enum":
            return f"{where} must be one of: {', '.join(map(str, schema['enum']))}"
        case "minimum" | "maximum" | "exclusiveMinimum":
            low, high = schema.get("minimum"), schema.get("maximum")
            if "exclusiveMinimum" in schema:
                return f"{where} must be greater than {schema['exclusiveMinimum']}"
            if low is not None and high is not None:
                return f"{where} must be between {low} and {high}"
            return (
                f"{where} must be at least {low}"
                if low is not None
                else f"{where} must be at most {high}"
            )
        case "required":
            instance = cast(dict[str, Any], error.instance)
            missing = [name for name in schema["required"] if name not in instance]
            return f"{_field(where, missing[0])} is required"
        case "additionalProperties":
            unknown = sorted(
                set(cast(dict[str, Any], error.instance)) - set(schema.get("properties", {}))
            )
            return f"unknown fields{' in ' + where if where else ''}: {', '.join(unknown)}"
    return f"{where or 'the request body'} does not match the API document ({kind})"


def _check(validator: Draft202012Validator, value: object, where: str = "") -> None:
    """InvalidArgument naming the field unless ``value`` matches the validator's schema
    (``where``: the name of ``value`` itself, for a query parameter)."""
    error = best_match(validator.iter_errors(value))
    if error is not None:
        if where:
            error.path.appendleft(where)
        raise InvalidArgument(_reason(error))


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class RequestContract:
    """The request bodies and query parameters of every operation in the document."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self._bodies: dict[tuple[str, str], Draft202012Validator] = {}
        self._queries: dict[tuple[str, str], dict[str, Draft202012Validator]] = {}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                if method == "parameters":
                    continue
                at = (path, method.upper())
                content = operation.get("requestBody", {}).get("content", {})
                if "application/json" in content:
                    self._bodies[at] = Draft202012Validator(content["application/json"]["schema"])
                self._queries[at] = {
                    p["name"]: Draft202012Validator(p["schema"])
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
        _check(self._bodies[self._route(request)], body)
        return body

    def query_int(self, request: web.Request, name: str) -> int | None:
        """Query parameter ``name`` as an integer in its documented range; its documented
        default (or None) when absent."""
        validator = self._queries[self._route(request)][name]
        raw = request.query.get(name)
        if raw is None:
            default: int | None = cast(Mapping[str, Any], validator.schema).get("default")
            return default
        try:
            value = int(raw)
        except ValueError:
            raise InvalidArgument(f"{name} must be an integer") from None
        _check(validator, value, name)
        return value


__all__ = ["INT64_MAX", "RequestContract"]
