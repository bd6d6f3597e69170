"""Bad input to the admin HTTP API is a 4xx JSON error naming the field, never a 500: every
parameter the OpenAPI document lists gets wrong types, out-of-range numbers and text that
is not valid Unicode, and nothing of it is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.server import Gateway
from tests.integration.sqlcheck import declare
from tests.support.fuzz import fuzz_settings
from tests.support.settings_cases import LARGEST, OUT_OF_RANGE

# Names the routes' path parameters take, so a request reaches its handler's checks.
_PATH = {"name": "q", "group": "g", "key": "k", "topic": "t"}
# Path parameter values that name nothing a client may touch.
_ODD_NAMES = ["%ED%A0%80", "%00", "%FF", ".hidden", "a" * 300, "%20"]
# Valid values for the required fields of a body, so the field under test is what is wrong.
_REQUIRED = {"name": "fresh", "to": "earliest"}
# One value of each JSON type; a field gets every one its schema does not allow.
_SAMPLES: dict[str, Any] = {
    "string": "x",
    "integer": 5,
    "number": 1.5,
    "boolean": True,
    "null": None,
    "object": {},
    "array": [],
}
# Raw JSON (json.dumps cannot write some of these) that no field takes.
_NEVER = ['"\\ud800"', "1e400", "-1e400", "NaN", "Infinity", str(2**64), str(-(2**64))]


def _wrong_values(schema: dict[str, Any]) -> Iterator[str]:
    """Raw JSON values ``schema`` refuses."""
    kinds = schema.get("type")
    allowed = {kinds} if isinstance(kinds, str) else set(kinds or ())
    for kind, value in _SAMPLES.items():
        fits = kind in allowed or (kind == "integer" and "number" in allowed)
        if allowed and not fits:
            yield json.dumps(value)
    for bound in ("minimum", "exclusiveMinimum"):
        if bound in schema:
            yield json.dumps(schema[bound] - (1 if bound == "minimum" else 0))
    if "maximum" in schema:
        yield json.dumps(schema["maximum"] + 1)
    if "enum" in schema:
        yield '"bogus"'
    if "object" in allowed:
        yield '{"\\ud800": "x"}'
        yield '{"x": "\\ud800"}'
    if "array" in allowed:
        yield '["\\ud800"]'
    yield from _NEVER


def _operations(
    document: dict[str, Any], *, odd: bool = False
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Every operation with its path filled in from _PATH; with ``odd``, once for each path
    parameter set to each of _ODD_NAMES instead."""
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if method == "parameters":
                continue
            if not odd:
                yield method.upper(), path.format(**_PATH), operation
                continue
            for name in set(_PATH) & {p["name"] for p in operations.get("parameters", ())}:
                for value in _ODD_NAMES:
                    yield method.upper(), path.format(**{**_PATH, name: value}), operation


def _body_schema(operation: dict[str, Any]) -> dict[str, Any] | None:
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    return None if body is None else body["schema"]


async def _document(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/api/openapi.json") as response:
        document: dict[str, Any] = await response.json()
        return document


async def _send(
    http: aiohttp.ClientSession, method: str, url: str, raw: str | None = None
) -> tuple[int, Any]:
    data = None if raw is None else raw.encode()
    headers = {"Content-Type": "application/json"}
    async with http.request(method, url, data=data, headers=headers) as response:
        text = await response.text()
        assert response.content_type == "application/json", (method, url, raw, text[:300])
        return response.status, json.loads(text)


def _assert_refused(status: int, answer: Any, what: object) -> None:
    assert 400 <= status < 500, (status, answer, what)
    assert set(answer) == {"error", "message"}, (answer, what)


async def _setup(gateway: Gateway) -> str:
    """Queue q (4 partitions) with group g on ``gateway``; the admin API's base URL."""
    await declare(gateway, "q", partitions=4)
    base = f"http://127.0.0.1:{gateway.ports['http']}"
    async with aiohttp.ClientSession() as http:
        status, _ = await _send(http, "POST", f"{base}/api/queues/q/groups", '{"name": "g"}')
        assert status == 201
    return base


@pytest.fixture
async def base(gateway: Gateway) -> str:
    return await _setup(gateway)


async def test_every_documented_parameter_refuses_bad_values_with_a_json_4xx(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        document = await _document(http, base)
        tried = 0
        for method, path, operation in _operations(document):
            schema = _body_schema(operation)
            for field, field_schema in (schema or {}).get("properties", {}).items():
                valid = {n: v for n, v in _REQUIRED.items() if n in schema.get("required", ())}
                for raw in _wrong_values(field_schema):
                    fields = [f"{json.dumps(n)}: {json.dumps(v)}" for n, v in valid.items()]
                    body = "{" + ", ".join([*fields, f"{json.dumps(field)}: {raw}"]) + "}"
                    status, answer = await _send(http, method, base + path, body)
                    _assert_refused(status, answer, (method, path, body))
                    tried += 1
                if "string" in field_schema.get("type", ()) and field != "payload":
                    # Text stored or looked up may not hold NUL (PostgreSQL's text cannot);
                    # a payload may (it is bytes).
                    body = json.dumps({**valid, field: "a\x00b"})
                    _assert_refused(*await _send(http, method, base + path, body), body)
            if schema is not None:
                for raw in ("[]", "null", '"x"', "{not json", '{"bogus": 1}'):
                    status, answer = await _send(http, method, base + path, raw)
                    _assert_refused(status, answer, (method, path, raw))
            for parameter in operation.get("parameters", ()):
                for raw in ("x", "1.5", "-1", str(2**63), "%ED%A0%80", "9" * 5000):
                    url = f"{base}{path}?{parameter['name']}={raw}"
                    _assert_refused(*await _send(http, method, url), url)
                    tried += 1
        for method, path, _ in _operations(document, odd=True):
            _assert_refused(*await _send(http, method, base + path, "{}"), (method, path))
            tried += 1
        status, stored = await _send(http, "GET", f"{base}/api/queues/q/messages")
        assert (status, stored) == (200, [])  # nothing bad was published
        status, groups = await _send(http, "GET", f"{base}/api/queues/q/groups")
        assert [g["name"] for g in groups] == ["g"]  # nor a group created
        status, queues = await _send(http, "GET", f"{base}/api/queues")
        assert sorted(q["name"] for q in queues) == ["q", "q.dlq"]  # nor a queue
    assert tried > 500


_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=8)
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ANY_TEXT, inner, max_size=3),
    max_leaves=6,
)


@fuzz_settings(examples=60)
@given(data=st.data())
async def test_any_json_value_in_any_body_field_is_never_a_server_error(
    base: str, data: st.DataObject
) -> None:
    async with aiohttp.ClientSession() as http:
        document = await _document(http, base)
        bodies = [(m, p, s) for m, p, o in _operations(document) if (s := _body_schema(o))]
        method, path, schema = data.draw(st.sampled_from(bodies))
        field = data.draw(st.sampled_from(sorted(schema["properties"])))
        body = {n: v for n, v in _REQUIRED.items() if n in schema.get("required", ())}
        body[field] = data.draw(_ANY_JSON)
        status, answer = await _send(http, method, base + path, json.dumps(body))
        assert status < 500, (status, answer, method, path, body)


@pytest.mark.parametrize(
    ("method", "path", "raw", "message"),
    [
        ("POST", "/groups", '{"name": "g2", "ack_timeout": "x"}', "ack_timeout must be a number"),
        ("POST", "/groups", '{"name": "g2", "tags": {"\\ud800": "x"}}', "field name in tags"),
        ("POST", "/groups", '{"name": "g2", "tags": {"t": "\\ud800"}}', "tags.t is not valid"),
        ("POST", "/groups", '{"name": "g2", "mode": "round"}', "mode must be one of"),
        ("GET", "/messages?from_seq=99999999999999999999999", None, "from_seq must be between"),
        ("GET", "/messages?from_seq=-1", None, "from_seq must be between 0 and"),
        ("GET", "/messages?partition=99999999999999999999", None, "partition must be between"),
        ("GET", "/messages?partition=4", None, "partition 4 out of range 0..3"),
        ("GET", "/messages?limit=1001", None, "limit must be between 1 and 1000"),
        ("POST", "/messages", '{"payload": "\\ud800"}', "payload is not valid Unicode"),
        ("POST", "/messages", '{"payload": "x", "key": "\\ud800"}', "key is not valid Unicode"),
        ("POST", "/redrive", '{"limit": 0}', "limit must be at least 1"),
        ("POST", "/redrive", '{"limit": 99999999999999999999}', "limit is out of range"),
        ("POST", "/redrive", '{"key": "a\\u0000b"}', "key contains a NUL character"),
        ("POST", "/groups/g/reset", '{"to": "earliest", "force": 1}', "force must be a boolean"),
    ],
)
async def test_a_bad_value_is_a_400_naming_the_field_on_either_database(
    base: str, method: str, path: str, raw: str | None, message: str
) -> None:
    async with aiohttp.ClientSession() as http:
        status, answer = await _send(http, method, f"{base}/api/queues/q{path}", raw)
        assert (status, answer["error"]) == (400, "invalid-argument"), answer
        assert message in answer["message"]
        _, groups = await _send(http, "GET", f"{base}/api/queues/q/groups")
        assert [g["name"] for g in groups] == ["g"]


async def test_an_integer_setting_out_of_range_is_a_400_naming_its_range_on_either_database(
    base: str,
) -> None:
    # PostgreSQL's INTEGER is 32 bits: window 2**40 was a 503 storage-error there (the
    # INSERT failed) and stored on SQLite.
    async with aiohttp.ClientSession() as http:
        for name, value, bounds in OUT_OF_RANGE:
            for method, path, body in (
                ("POST", "/api/queues", {"name": "fresh", name: value}),
                ("PATCH", "/api/queues/q", {name: value}),
            ):
                status, answer = await _send(http, method, base + path, json.dumps(body))
                assert (status, answer) == (
                    400,
                    {"error": "invalid-argument", "message": f"{name} must be {bounds}"},
                ), (method, body)
        status, queues = await _send(http, "GET", f"{base}/api/queues")
        assert sorted(q["name"] for q in queues) == ["q", "q.dlq"]
        status, queue = await _send(http, "GET", f"{base}/api/queues/q")
        assert (queue["window"], queue["max_deliveries"]) == (10_000, 16)
        # The largest value of each is stored and read back.
        body = json.dumps({"name": "largest", **LARGEST})
        assert (await _send(http, "POST", f"{base}/api/queues", body))[0] == 201
        status, queue = await _send(http, "GET", f"{base}/api/queues/largest")
        assert {name: queue[name] for name in LARGEST} == LARGEST
        body = json.dumps({"max_deliveries": 0, "window": 1})
        assert (await _send(http, "PATCH", f"{base}/api/queues/largest", body))[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "raw"),
    [
        ("POST", "/groups/g/keys/k/release", "{}"),
        ("POST", "/groups/g/reset", '{"to": "earliest"}'),
        ("DELETE", "/groups/g", None),
    ],
)
async def test_a_group_route_under_a_missing_queue_says_the_queue_is_missing(
    base: str, method: str, path: str, raw: str | None
) -> None:
    async with aiohttp.ClientSession() as http:
        status, answer = await _send(http, method, f"{base}/api/queues/nosuch{path}", raw)
    assert (status, answer["error"]) == (404, "queue-not-found")
