"""The measured cases of issue 18, with real clients on SQLite and PostgreSQL: an odd
message on any protocol is rejected cleanly (or stored and delivered), and a client-ack
consumer of the queue receives every ordinary message published after it. No error a
client sees carries SQL or another client's data.

stomp.py, pika and paho are blocking: each runs in a worker thread while the gateway
serves on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import paho.mqtt.client as paho
import pika
import pika.exceptions
import pytest
import sqlalchemy as sa
import stomp
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from sqlalchemy.ext.asyncio import AsyncConnection

from core.errors import InvalidArgument, KeygateError
from gateway.client import Client, Consumer
from gateway.server import Gateway
from storage.schema import kg_messages
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import Row, Sql, declare, open_sql
from tests.support.fuzz import fuzz_settings

HOST = "127.0.0.1"
WAIT = 10.0
SQL_WORDS = ("INSERT", "parameters", "SELECT", "Traceback")


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


class StompOutcome(stomp.ConnectionListener):  # type: ignore[misc]
    """The RECEIPT or ERROR that answers a SEND."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.receipt: str | None = None
        self.error: str | None = None

    def on_receipt(self, frame: Any) -> None:
        if self.done.is_set():
            return  # the DISCONNECT's own receipt, after the answer was recorded
        self.receipt = frame.headers["receipt-id"]
        self.done.set()

    def on_error(self, frame: Any) -> None:
        if self.done.is_set():
            return
        self.error = f"{frame.headers.get('message', '')} {frame.body}"
        self.done.set()

    def on_disconnected(self) -> None:
        self.done.set()


def stomp_send(port: int, body: str | bytes, headers: dict[str, str]) -> StompOutcome:
    """One SEND with a receipt on a fresh connection (STOMP closes after an ERROR)."""
    conn = stomp.Connection12([(HOST, port)])
    outcome = StompOutcome()
    conn.set_listener("outcome", outcome)
    conn.connect(wait=True)
    try:
        conn.send("/queue/q", body, headers=headers, receipt="r")
        assert outcome.done.wait(WAIT)
    finally:
        # After an ERROR the gateway closes the socket; stomp.py's DISCONNECT may race it.
        with contextlib.suppress(OSError, stomp.exception.NotConnectedException):
            if conn.is_connected():
                conn.disconnect()
    return outcome


async def consume(consumer: Consumer, wanted: set[bytes]) -> set[bytes]:
    """Receive and acknowledge until every payload of ``wanted`` arrived; return all seen."""
    seen: set[bytes] = set()
    while not wanted <= seen:
        message = await consumer.receive(timeout=WAIT)
        seen.add(message.payload)
        await consumer.acknowledge(message)
    return seen


async def publish_ordinary(gateway: Gateway, tag: str, count: int = 5) -> set[bytes]:
    async with Client(native_url(gateway)) as client:
        payloads = [f"{tag}-{i}".encode() for i in range(count)]
        for i, payload in enumerate(payloads):
            await client.publish("q", payload, key=f"k{i}")
    return set(payloads)


@pytest.fixture
async def consumer(gateway: Gateway) -> AsyncIterator[Consumer]:
    await declare(gateway, "q", partitions=4, subscriptions=["q/#"])
    async with Client(native_url(gateway)) as client:
        yield await client.subscribe("q", group="g")


async def test_a_stomp_send_with_a_70_kb_header_is_refused_and_later_messages_flow(
    gateway: Gateway, consumer: Consumer, sql: Sql
) -> None:
    port = gateway.ports["stomp"]
    odd = await asyncio.to_thread(stomp_send, port, "odd", {"big": "v" * 70_000})
    assert odd.receipt is None and odd.error is not None
    assert not any(word in odd.error for word in SQL_WORDS)
    after = await asyncio.to_thread(stomp_send, port, "stomp-after", {"JMSXGroupID": "k"})
    assert after.receipt == "r"
    wanted = await publish_ordinary(gateway, "native") | {b"stomp-after"}
    assert b"odd" not in await consume(consumer, wanted)
    assert b"odd" not in {r.payload for r in await sql.messages("q")}


def pika_publish(port: int, headers: dict[str, Any], body: bytes) -> bool:
    """Publish with confirms; True when confirmed, False when nacked."""
    connection = pika.BlockingConnection(pika.ConnectionParameters(HOST, port))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            channel.basic_publish("", "q", body, pika.BasicProperties(headers=headers))
        except pika.exceptions.NackError:
            return False
        assert connection.is_open and channel.is_open
        return True
    finally:
        connection.close()


async def test_an_amqp_publish_with_a_70_kb_string_header_is_nacked_and_later_messages_flow(
    gateway: Gateway, consumer: Consumer
) -> None:
    port = gateway.ports["amqp"]
    assert not await asyncio.to_thread(pika_publish, port, {"big": "v" * 70_000}, b"odd")
    assert await asyncio.to_thread(pika_publish, port, {"JMSXGroupID": "k"}, b"amqp-after")
    wanted = await publish_ordinary(gateway, "native") | {b"amqp-after"}
    assert b"odd" not in await consume(consumer, wanted)


def mqtt5_publish(
    port: int,
    payload: bytes,
    correlation: bytes | None,
    user: tuple[tuple[str, str], ...] = (),
) -> int:
    """A QoS 1 publish to ``q/x``; returns the PUBACK reason code."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    acked = threading.Event()
    codes: list[int] = []

    def on_publish(_c: Any, _u: Any, _mid: int, reason: Any, _p: Any) -> None:
        codes.append(reason.value)
        acked.set()

    client.on_publish = on_publish
    client.connect(HOST, port)
    client.loop_start()
    try:
        props = Properties(PacketTypes.PUBLISH)
        if correlation is not None:
            props.CorrelationData = correlation
        if user:
            props.UserProperty = list(user)
        client.publish("q/x", payload, qos=1, properties=props)
        assert acked.wait(WAIT)
    finally:
        client.disconnect()
        client.loop_stop()
    return codes[0]


async def test_an_mqtt5_publish_with_40_kb_correlation_data_is_stored_without_correlation_id(
    gateway: Gateway, consumer: Consumer, sql: Sql
) -> None:
    """Correlation Data too long for ``correlation_id`` (1,024 bytes, as text or hex) still
    travels whole in ``x-mqtt-correlation-data`` (docs/protocols/mqtt.md)."""
    port = gateway.ports["mqtt"]
    assert await asyncio.to_thread(mqtt5_publish, port, b"odd", b"c" * 40_000) == 0
    assert await asyncio.to_thread(mqtt5_publish, port, b"mqtt-after", b"c" * 100) == 0
    (odd,) = [r for r in await sql.messages("q") if r.payload == b"odd"]
    assert odd.correlation_id is None
    assert odd.properties["x-mqtt-correlation-data"] == b"c" * 40_000
    wanted = await publish_ordinary(gateway, "native") | {b"odd", b"mqtt-after"}
    await consume(consumer, wanted)


def http_post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("value", [None, [1, 2], {"b": 1}])
async def test_an_http_publish_with_a_null_list_or_object_property_is_a_400_and_stores_nothing(
    gateway: Gateway, sql: Sql, value: Any
) -> None:
    await declare(gateway, "q", partitions=4)
    body = {"payload": "odd", "properties": {"a": value}}
    status, answer = await asyncio.to_thread(
        http_post, gateway.ports["http"], "/api/queues/q/messages", body
    )
    assert status == 400
    assert answer["message"] == (
        "message rejected: property 'a' has unsupported type "
        f"{'null' if value is None else type(value).__name__} (use str, int, float, bool or bytes)"
    )
    assert await sql.messages("q") == []


async def test_stomp_sends_with_a_5000_character_group_id_fail_alone_beside_native_publishes(
    gateway: Gateway, consumer: Consumer, sql: Sql
) -> None:
    port = gateway.ports["stomp"]
    bad = [
        asyncio.to_thread(stomp_send, port, f"bad-{i}", {"JMSXGroupID": "g" * 5000})
        for i in range(15)
    ]
    async with Client(native_url(gateway)) as client:
        good = [client.publish("q", b"good-%d" % i, key=f"k{i % 50}") for i in range(1500)]
        results = await asyncio.gather(*good, *bad, return_exceptions=True)
    confirmed, refused = results[:1500], results[1500:]
    assert not [r for r in confirmed if isinstance(r, BaseException)]
    for outcome in refused:
        assert isinstance(outcome, StompOutcome) and outcome.error is not None
        assert "key longer than 4096 bytes" in outcome.error
        assert not any(word in outcome.error for word in SQL_WORDS)
    stored = {r.payload for r in await sql.messages("q")}
    assert len(stored) == 1500 and not any(p.startswith(b"bad") for p in stored)


async def test_a_native_hello_with_a_600_character_client_name_is_refused_cleanly(
    gateway: Gateway, consumer: Consumer
) -> None:
    with pytest.raises(InvalidArgument, match="client name longer than 500 bytes"):
        async with Client(
            native_url(gateway), client_name="c" * 600, max_reconnect_attempts=0
        ) as client:
            await client.publish("q", b"never")
    wanted = await publish_ordinary(gateway, "native")
    assert await consume(consumer, wanted) == wanted


async def test_a_bind_with_a_window_of_3_billion_is_refused_and_the_group_keeps_delivering(
    gateway: Gateway, consumer: Consumer
) -> None:
    async with Client(native_url(gateway)) as client:
        with pytest.raises(KeygateError, match="window must be between 0 and"):
            await client.subscribe("q", group="g", window=3_000_000_000)
        wanted = await publish_ordinary(gateway, "native")
        assert await consume(consumer, wanted) == wanted


@pytest.mark.parametrize(
    "properties",
    [{"a": None}, {"a": [1, 2]}, {"a": {"b": 1}}, {"big": "v" * 70_000}],
    ids=["null", "list", "object", "unencodable-70kb-string"],
)
async def test_a_stored_row_that_cannot_be_delivered_is_dead_lettered_and_later_messages_flow(
    gateway: Gateway, sql: Sql, properties: dict[str, Any]
) -> None:
    async def damage(conn: AsyncConnection, message_id: str) -> None:
        await conn.execute(
            sa.update(kg_messages)
            .where(kg_messages.c.message_id == message_id)
            .values(properties=properties)
        )

    await _dead_letter_a_damaged_row(gateway, sql, damage)


async def test_a_stored_row_whose_properties_are_not_json_is_dead_lettered_as_it_was(
    gateway: Gateway, sql: Sql
) -> None:
    if sql.engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL's JSONB cannot hold text that is not JSON")

    async def damage(conn: AsyncConnection, message_id: str) -> None:
        text = "UPDATE kg_messages SET properties = '{not json' WHERE message_id = :id"
        await conn.execute(sa.text(text), {"id": message_id})

    letter = await _dead_letter_a_damaged_row(gateway, sql, damage)
    assert letter.properties["x-unreadable-properties"] == "{not json"


async def _dead_letter_a_damaged_row(
    gateway: Gateway, sql: Sql, damage: Callable[[AsyncConnection, str], Awaitable[None]]
) -> Row:
    """Publish a message and ``damage`` its row, as an older version (or a hand edit) could
    have written it; a consumer then gets every later message, and the damaged one is
    dead-lettered as undeliverable. Returns the dead letter."""
    await declare(gateway, "q", partitions=1)
    async with Client(native_url(gateway)) as client:
        first = await client.publish("q", b"old-row")
        async with sql.engine.begin() as conn:
            await damage(conn, first)
        consumer = await client.subscribe("q", group="g")
        wanted = await publish_ordinary(gateway, "after")
        assert b"old-row" not in await consume(consumer, wanted)
    [letter] = await sql.wait_messages("q.dlq", 1)
    assert letter.payload == b"old-row"
    assert letter.properties["x-dead-letter-reason"] == "undeliverable"
    return letter


# --- property: odd but legal messages on every protocol never stop the ordinary ones -------

_TEXT = st.text(st.characters(exclude_categories=["Cs", "Cc"]), max_size=40)
_LONG = st.sampled_from(["", "é" * 3000, "k" * 4096, "v" * 60_000, "\u2603" * 100])
_VALUES = st.one_of(
    _TEXT,
    _LONG,
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.binary(max_size=100),
)


@st.composite
def odd_messages(draw: st.DrawFn) -> dict[str, Any]:
    names = st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=30)
    return {
        "payload": draw(st.sampled_from([b"", b"\x00" * 10, b"odd-" + bytes(range(256))])),
        "key": draw(st.one_of(st.none(), _TEXT, _LONG)),
        "properties": draw(st.dictionaries(names, _VALUES, max_size=5)),
    }


def _strings(properties: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else repr(v) for k, v in properties.items()}


async def _send_everywhere(gateway: Gateway, odd: dict[str, Any]) -> None:
    """The odd message over every protocol; each may accept or refuse it."""
    payload, key, properties = odd["payload"], odd["key"], odd["properties"]
    keyed = {**properties, **({"JMSXGroupID": key} if key is not None else {})}
    async with Client(native_url(gateway)) as client:
        with contextlib.suppress(KeygateError):
            await client.publish("q", payload, key=key, properties=properties)
    stomp_headers = {k: v for k, v in _strings(keyed).items() if k != "content-length"}
    # pika has no float field type: floats travel as text there.
    amqp_headers = {k: repr(v) if isinstance(v, float) else v for k, v in keyed.items()}
    await asyncio.gather(
        asyncio.to_thread(stomp_send, gateway.ports["stomp"], payload, stomp_headers),
        asyncio.to_thread(pika_publish, gateway.ports["amqp"], amqp_headers, payload),
        asyncio.to_thread(
            mqtt5_publish, gateway.ports["mqtt"], payload, None, tuple(_strings(keyed).items())
        ),
        asyncio.to_thread(
            http_post,
            gateway.ports["http"],
            "/api/queues/q/messages",
            {"payload": payload.decode("latin-1"), "key": key, "properties": _strings(keyed)},
        ),
    )


@given(odd=st.lists(odd_messages(), min_size=1, max_size=3))
@fuzz_settings(4)
async def test_odd_but_legal_messages_on_every_protocol_never_stop_the_ordinary_ones_after_them(
    gateway: Gateway, consumer: Consumer, odd: list[dict[str, Any]]
) -> None:
    for message in odd:
        await _send_everywhere(gateway, message)
    wanted = await publish_ordinary(gateway, f"after-{uuid.uuid4().hex}")
    await consume(consumer, wanted)
