"""A graceful stop (SIGTERM runs ``Gateway.stop``) with publishes in flight on every
protocol: what the gateway received is committed and confirmed before the connection
closes (docs/operations.md), so each message found stored was confirmed to its client
and a client never has to resend a stored message. The clients read until the server
closes the socket and count the confirms they got."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest
import sqlalchemy as sa

from gateway.client import Client
from gateway.server import Gateway
from protocols.mqtt import MQTT_3_1_1, MQTT_5, Connect, Disconnect, PubAck, Publish
from protocols.stomp import Frame
from storage.engine import async_engine
from tests.integration.conftest import native_url, start_gateway
from tests.support.amqp_raw import RawAmqp
from tests.support.mqtt_raw import RawMqtt
from tests.support.stomp_raw import raw
from tests.support.wait import eventually

QUEUE = "stopping"
IN_FLIGHT = 200  # unconfirmed publishes a client keeps on the wire


async def _stored(db_url: str) -> set[bytes]:
    engine = async_engine(db_url)
    try:
        async with engine.connect() as conn:
            query = sa.text("SELECT payload FROM kg_messages WHERE queue = :q")
            return {bytes(row[0]) for row in await conn.execute(query, {"q": QUEUE})}
    finally:
        await engine.dispose()


@pytest.fixture
async def running(db_url: str) -> AsyncIterator[Gateway]:
    gateway = await start_gateway(db_url)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue(QUEUE, partitions=2, subscriptions=["stop/#"])
        yield gateway
    finally:
        await gateway.stop()
        await RawMqtt.close_all()


async def _publish_until_closed(
    send: Callable[[int], None],
    confirmed: Callable[[], int],
    reading: asyncio.Task[None],
    writer: asyncio.StreamWriter,
) -> None:
    """Send publish after publish (``send(i)``), never more than ``IN_FLIGHT`` unconfirmed,
    until the server has closed the connection (``reading`` ended), then close."""
    sent = 0
    while not reading.done():
        while sent - confirmed() < IN_FLIGHT:
            send(sent)
            sent += 1
        await asyncio.sleep(0)  # let the reader see confirms (it polls nothing)
    writer.transport.abort()


async def _stop_under_load(gateway: Gateway, confirmed: Callable[[], int]) -> None:
    """Stop once the publisher is well under way: confirms back, more in flight."""
    await eventually(lambda: confirmed() > 3 * IN_FLIGHT, interval=0.001)
    await gateway.stop()


async def test_a_stop_confirms_every_amqp_publish_it_stored(
    db_url: str, running: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    amqp = await RawAmqp.confirming(running.ports["amqp"])
    reading = asyncio.create_task(amqp.read_confirms())

    def send(i: int) -> None:
        amqp.writer.write(RawAmqp.publish_frames(QUEUE, b"%d" % i))

    def confirmed() -> int:
        return len(amqp.acked)

    await asyncio.gather(
        _publish_until_closed(send, confirmed, reading, amqp.writer),
        _stop_under_load(running, confirmed),
    )
    await reading
    stored = {int(payload) + 1 for payload in await _stored(db_url)}  # delivery tags
    assert amqp.nacked == set()
    assert stored == amqp.acked
    # The goodbye comes after the confirms, so a client learns why the server closed.
    assert amqp.closed_by is not None and amqp.closed_by.reply_code == 320
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("version", [MQTT_3_1_1, MQTT_5])
async def test_a_stop_acknowledges_every_mqtt_publish_it_stored(
    db_url: str, running: Gateway, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    mqtt = await RawMqtt.connected(running.ports["mqtt"], Connect("stopper", version))
    in_flight: dict[int, int] = {}  # packet id -> publish number
    acked: set[int] = set()
    last: list[object] = []

    async def read() -> None:
        while (packet := await mqtt.receive()) is not None:
            if isinstance(packet, PubAck):
                assert packet.reason_code == 0
                acked.add(in_flight.pop(packet.packet_id))
            last.append(packet)

    reading = asyncio.create_task(read())

    def send(i: int) -> None:
        packet_id = i % 65535 + 1
        in_flight[packet_id] = i
        mqtt.writer.write(mqtt.codec.send(Publish("stop/x", b"%d" % i, qos=1, packet_id=packet_id)))

    def confirmed() -> int:
        return len(acked)

    await asyncio.gather(
        _publish_until_closed(send, confirmed, reading, mqtt.writer),
        _stop_under_load(running, confirmed),
    )
    await reading
    stored = {int(payload) for payload in await _stored(db_url)}
    assert stored == acked
    if version == MQTT_5:
        # Server shutting down, after the acknowledgements.
        assert isinstance(last[-1], Disconnect) and last[-1].reason_code == 0x8B
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stop_receipts_every_stomp_send_it_stored(
    db_url: str, running: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """STOMP drains through the same listener kit: the same promise."""
    async with raw(running.ports["stomp"]) as stomp:
        await stomp.connect()
        receipted: set[int] = set()

        async def read() -> None:
            while (frame := await stomp.frame()) is not None:
                if frame.command == "RECEIPT":
                    receipted.add(int(frame.header("receipt-id") or ""))

        reading = asyncio.create_task(read())

        def send(i: int) -> None:
            headers = (("destination", f"/queue/{QUEUE}"), ("receipt", str(i)))
            stomp.writer.write(stomp.codec.send(Frame("SEND", headers, b"%d" % i)))

        def confirmed() -> int:
            return len(receipted)

        await asyncio.gather(
            _publish_until_closed(send, confirmed, reading, stomp.writer),
            _stop_under_load(running, confirmed),
        )
        await reading
    stored = {int(payload) for payload in await _stored(db_url)}
    assert stored == receipted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
