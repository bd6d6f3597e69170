"""STOMP publishers through the real gateway into SQL (docs/protocols/stomp.md), and one
key published over MQTT, AMQP and STOMP landing in one partition, consumed with the SDK.

stomp.py, paho and pika are blocking, so each scenario runs in a worker thread while the
gateway serves on the test's event loop. A scenario returns once its RECEIPT (or ack)
arrived; the SQL read that follows does not poll, which proves the row was committed
before the confirm was sent (DESIGN.md §3.4).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import paho.mqtt.client as paho
import pika
import pytest
import stomp
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from core.keys import partition_for
from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import KEY, Sql, declare, open_sql
from tests.support.delay import DELAY_MS, DELAYED, UNDELAYED, assert_delay_honoured

VERSIONS = [stomp.Connection10, stomp.Connection11, stomp.Connection12]
WAIT = 10.0


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


class Recorder(stomp.ConnectionListener):  # type: ignore[misc]
    """RECEIPT and ERROR frames, for a worker thread to wait on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.receipts: list[str] = []
        self.errors: list[Any] = []

    def on_receipt(self, frame: Any) -> None:
        with self.cond:
            self.receipts.append(frame.headers["receipt-id"])
            self.cond.notify_all()

    def on_error(self, frame: Any) -> None:
        with self.cond:
            self.errors.append(frame)
            self.cond.notify_all()

    def wait_receipt(self, receipt: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: receipt in self.receipts, WAIT), receipt

    def wait_error(self) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: self.errors, WAIT), "no ERROR frame"
            return self.errors[0]


def _connect(cls: Any, gateway: Gateway, **headers: str) -> tuple[Any, Recorder]:
    conn = cls([("127.0.0.1", gateway.ports["stomp"])], reconnect_attempts_max=1)
    recorder = Recorder()
    conn.set_listener("recorder", recorder)
    conn.connect(wait=True, headers=headers)
    return conn, recorder


def _close(conn: Any) -> None:
    # After an ERROR the gateway closes the socket: stomp.py may still think it is
    # connected for a moment, and its DISCONNECT then fails on the closed socket.
    with contextlib.suppress(OSError, stomp.exception.NotConnectedException):
        if conn.is_connected():
            conn.disconnect()


@pytest.mark.parametrize("cls", VERSIONS, ids=["1.0", "1.1", "1.2"])
async def test_send_to_a_queue_is_partitioned_by_jmsxgroupid_with_headers_as_properties(
    gateway: Gateway, sql: Sql, cls: Any
) -> None:
    await declare(gateway, "orders", partitions=16)

    def send() -> None:
        conn, recorder = _connect(cls, gateway, **{"client-id": "stomp-it"})
        try:
            conn.send(
                "/queue/orders",
                "payload",
                content_type="text/plain",
                headers={
                    "JMSXGroupID": KEY,
                    "region": "eu",
                    "priority": "4",
                    "persistent": "true",
                    "correlation-id": "c-1",
                    "reply-to": "/queue/replies",
                    "message-id": "m-1",
                    "expires": "4102444800000",
                    "receipt": "r-1",
                },
            )
            recorder.wait_receipt("r-1")
        finally:
            _close(conn)

    await asyncio.to_thread(send)
    (row,) = await sql.messages("orders")
    assert (row.payload, row.key, row.partition) == (b"payload", KEY, 3)
    assert (row.content_type, row.correlation_id, row.reply_to) == (
        "text/plain",
        "c-1",
        "/queue/replies",
    )
    assert (row.dedup_id, row.expire_at, row.producer) == ("m-1", 4_102_444_800.0, "stomp:stomp-it")
    p = row.properties
    assert (p["JMSXGroupID"], p["region"], p["priority"], p["persistent"]) == (
        KEY,
        "eu",
        "4",
        "true",
    )
    assert "receipt" not in p and "destination" not in p


async def test_send_to_a_topic_routes_through_the_queue_subscription(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, subscriptions=["orders/#"])

    def send() -> None:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            conn.send("/topic/orders.eu", "eu", headers={"JMSXGroupID": KEY, "receipt": "t"})
            recorder.wait_receipt("t")
        finally:
            _close(conn)

    await asyncio.to_thread(send)
    (row,) = await sql.messages("orders")
    assert (row.payload, row.topic, row.partition) == (b"eu", "orders/eu", 3)
    assert row.producer is not None and row.producer.startswith("stomp:")


async def test_commit_stores_the_whole_transaction_and_abort_stores_none_of_it(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16)
    committed: list[bytes] = []

    async def rows() -> list[bytes]:
        return [r.payload for r in sorted(await sql.messages("orders"), key=lambda r: r.seq)]

    def commit_then_abort(loop: asyncio.AbstractEventLoop) -> None:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            tx = conn.begin()
            for i in range(3):
                conn.send("/queue/orders", f"tx-{i}", headers={"JMSXGroupID": KEY}, transaction=tx)
            conn.commit(tx, headers={"receipt": "commit"})
            recorder.wait_receipt("commit")
            committed.extend(asyncio.run_coroutine_threadsafe(rows(), loop).result(WAIT))
            tx = conn.begin()
            for i in range(3):
                conn.send("/queue/orders", f"aborted-{i}", transaction=tx)
            conn.abort(tx)
            conn.send("/queue/orders", "after", headers={"JMSXGroupID": KEY, "receipt": "after"})
            recorder.wait_receipt("after")
        finally:
            _close(conn)

    await asyncio.to_thread(commit_then_abort, asyncio.get_running_loop())
    assert committed == [b"tx-0", b"tx-1", b"tx-2"]
    assert await rows() == [b"tx-0", b"tx-1", b"tx-2", b"after"]


async def test_body_with_nul_bytes_is_stored_byte_exact(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "blobs")
    body = bytes(range(256)) * 3 + b"\x00\x00"

    def send() -> None:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            conn.send(
                "/queue/blobs", body, headers={"content-length": str(len(body)), "receipt": "b"}
            )
            recorder.wait_receipt("b")
        finally:
            _close(conn)

    await asyncio.to_thread(send)
    (row,) = await sql.messages("blobs")
    assert row.payload == body


@pytest.mark.parametrize("destination", ["/queue/missing", "/topic/nowhere.eu", "/exchange/x"])
async def test_unknown_destination_gets_an_error_frame_and_nothing_is_stored(
    gateway: Gateway, sql: Sql, destination: str
) -> None:
    await declare(gateway, "orders", subscriptions=["orders/#"])

    def send() -> Any:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            conn.send(destination, "lost", headers={"receipt": "lost"})
            return recorder.wait_error()
        finally:
            _close(conn)

    error = await asyncio.to_thread(send)
    assert error.headers["message"] == "unknown destination"
    assert error.headers.get("receipt-id") == "lost"
    assert await sql.messages("orders") == []


async def test_amq_scheduled_delay_holds_a_message_back_while_a_later_undelayed_one_flows(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later", partitions=4)

    def publish_both() -> None:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            for (payload, key), delay in (
                (DELAYED, {"AMQ_SCHEDULED_DELAY": str(DELAY_MS)}),
                (UNDELAYED, {}),
            ):
                headers = {"JMSXGroupID": key, "receipt": key, **delay}
                conn.send("/queue/later", payload, headers=headers)
                recorder.wait_receipt(key)
        finally:
            _close(conn)

    await assert_delay_honoured(native_url(gateway), "later", publish_both)
    delayed = next(r for r in await sql.messages("later") if r.payload == DELAYED[0])
    assert delayed.deliver_at is not None
    assert delayed.deliver_at - delayed.publish_time == pytest.approx(DELAY_MS / 1000)
    assert delayed.properties["AMQ_SCHEDULED_DELAY"] == str(DELAY_MS)


async def test_an_amq_scheduled_delay_that_is_not_a_delay_gets_an_error_frame(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later")

    def send() -> Any:
        conn, recorder = _connect(stomp.Connection12, gateway)
        try:
            conn.send(
                "/queue/later", "bad", headers={"AMQ_SCHEDULED_DELAY": "-5", "receipt": "bad"}
            )
            return recorder.wait_error()
        finally:
            _close(conn)

    error = await asyncio.to_thread(send)
    assert (error.headers["message"], error.headers.get("receipt-id")) == ("invalid frame", "bad")
    assert "invalid AMQ_SCHEDULED_DELAY '-5'" in error.body
    assert await sql.messages("later") == []


def _publish_mqtt(gateway: Gateway) -> None:
    acked = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="x-mqtt", protocol=paho.MQTTv5)
    client.on_publish = lambda *_args: acked.set()
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = [("JMSXGroupID", KEY), ("via", "mqtt")]
    client.connect("127.0.0.1", gateway.ports["mqtt"])
    client.loop_start()
    try:
        client.publish("orders/mqtt", b"from mqtt", 1, properties=props)
        assert acked.wait(WAIT), "no PUBACK"
    finally:
        client.disconnect()
        client.loop_stop()


def _publish_amqp(gateway: Gateway) -> None:
    connection = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", gateway.ports["amqp"], connection_attempts=1)
    )
    channel = connection.channel()
    channel.confirm_delivery()
    headers = {"JMSXGroupID": KEY, "via": "amqp"}
    channel.basic_publish("", "orders", b"from amqp", pika.BasicProperties(headers=headers))
    connection.close()


def _publish_stomp(gateway: Gateway) -> None:
    conn, recorder = _connect(stomp.Connection12, gateway)
    try:
        headers = {"JMSXGroupID": KEY, "via": "stomp", "receipt": "s"}
        conn.send("/queue/orders", "from stomp", headers=headers)
        recorder.wait_receipt("s")
    finally:
        _close(conn)


async def test_one_key_over_mqtt_amqp_and_stomp_lands_in_one_partition_and_is_consumable(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, subscriptions=["orders/#"])
    async with Client(native_url(gateway), client_name="cross") as client:
        consumer = await client.subscribe("orders", group="g")
        for publish in (_publish_mqtt, _publish_amqp, _publish_stomp):
            await asyncio.to_thread(publish, gateway)
        rows = await sql.messages("orders")
        assert [(r.payload, r.key, r.partition) for r in rows] == [
            (b"from mqtt", KEY, 3),
            (b"from amqp", KEY, 3),
            (b"from stomp", KEY, 3),
        ]
        assert [r.seq for r in rows] == sorted(r.seq for r in rows)
        received = []
        for _ in rows:
            message = await consumer.receive(timeout=WAIT)
            received.append(message)
            await consumer.acknowledge(message)
    assert [(m.payload, m.key, m.partition) for m in received] == [
        (r.payload, r.key, r.partition) for r in rows
    ]
    assert [m.properties["via"] for m in received] == ["mqtt", "amqp", "stomp"]
    assert all(m.properties["JMSXGroupID"] == KEY for m in received)
    assert received[0].topic == "orders/mqtt"
    assert partition_for(KEY, 16) == 3


async def test_stomp_message_id_is_deduped_only_on_a_dedup_enabled_queue(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "payments", dedup_window=60)
    await declare(gateway, "orders")

    def send() -> None:
        conn, recorder = _connect(stomp.Connection12, gateway, **{"client-id": "stomp-dedup"})
        try:
            for queue in ("payments", "orders"):
                for body in ("first", "again"):
                    receipt = f"{queue}-{body}"
                    headers = {"message-id": "tx-1", "receipt": receipt}
                    conn.send(f"/queue/{queue}", body, headers=headers)
                    recorder.wait_receipt(receipt)  # both confirmed
        finally:
            _close(conn)

    await asyncio.to_thread(send)
    assert [r.payload for r in await sql.messages("payments")] == [b"first"]
    assert [r.payload for r in await sql.messages("orders")] == [b"first", b"again"]


async def test_an_empty_stomp_message_id_is_no_dedup_id(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "payments", dedup_window=60)

    def send() -> None:
        conn, recorder = _connect(stomp.Connection12, gateway, **{"client-id": "stomp-empty"})
        try:
            for body in ("first", "second"):
                conn.send("/queue/payments", body, headers={"message-id": "", "receipt": body})
                recorder.wait_receipt(body)
        finally:
            _close(conn)

    await asyncio.to_thread(send)
    rows = await sql.messages("payments")
    assert [(r.payload, r.dedup_id) for r in rows] == [(b"first", None), (b"second", None)]
