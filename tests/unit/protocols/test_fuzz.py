"""Fuzzing: mutated valid frames into the native codec and connection, and raw bytes into
the AMQP, MQTT and STOMP listeners (codec, connection state machine and adapter at once).
Only clean protocol errors may come out: no other exception, no traceback in the log, and
the listener keeps serving. ``KEYGATE_FUZZ_EXAMPLES`` runs longer (tests/support/fuzz.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hypothesis import given
from pamqp import commands, frame

from core.model import AckMode, GroupMode
from protocols.amqp import AmqpListener
from protocols.amqp.codec import content_frames
from protocols.mqtt import MQTT_3_1_1, MQTT_5, Connect, MqttCodec, MqttProperties, Publish
from protocols.mqtt.listener import MqttListener
from protocols.native import (
    Ack,
    Bind,
    Close,
    Credit,
    DeclareQueue,
    Hello,
    Nack,
    NackOutcome,
    NativeProtocolError,
    Ping,
    ServerConnection,
    Unbind,
    encode,
)
from protocols.native import Publish as NativePublish
from protocols.sink import Listener
from protocols.stomp.listener import StompListener
from tests.support.fuzz import fuzz_settings, mutated
from tests.support.memory_sink import MemorySink

HOST = "127.0.0.1"

# --- native: codec and server connection, in process --------------------------------------

NATIVE_STREAM = b"".join(
    encode(event)
    for event in (
        Hello(request_id=1, client_name="app", username="u", password="p"),
        NativePublish(
            request_id=2,
            queue="orders",
            key="k",
            payload=b"hello",
            properties={"s": "v", "i": 7, "f": 1.5, "b": b"\x00", "t": True},
            ttl=3.0,
            dedup_id="d",
        ),
        Bind(
            request_id=3,
            queue="orders",
            group="g",
            window=10,
            ack_mode=AckMode.CLIENT,
            tags={"a": "b"},
            mode=GroupMode.PARTITIONED,
            previous_partitions=frozenset({1, 2}),
        ),
        Ack(flow_id="f", message_ids=("m1", "m2")),
        Nack(flow_id="f", message_ids=("m3",), outcome=NackOutcome.RETRY, delay=0.5),
        Credit(flow_id="f", window=5),
        DeclareQueue(request_id=4, name="q", settings={"partitions": 4}),
        Unbind(request_id=5, flow_id="f"),
        Ping(request_id=6),
        Close(),
    )
)


@given(mutated([NATIVE_STREAM]))
@fuzz_settings(500)
def test_mutated_native_frames_raise_nothing_but_protocol_errors(data: bytes) -> None:
    conn = ServerConnection()
    try:
        conn.receive_data(data)
        while (event := conn.next_event()) is not None:
            if isinstance(event, Hello):
                conn.send(conn.accept("kg", "session"))
    except NativeProtocolError:
        pass


# --- AMQP, MQTT, STOMP: raw bytes through the real listeners -------------------------------

AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
AMQP_STREAM = b"".join(
    [
        AMQP_HEADER,
        frame.marshal(
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest"
            ),
            0,
        ),
        frame.marshal(commands.Connection.TuneOk(channel_max=10, frame_max=4096), 0),
        frame.marshal(commands.Connection.Open(), 0),
        frame.marshal(commands.Channel.Open(), 1),
        frame.marshal(commands.Confirm.Select(), 1),
        frame.marshal(commands.Queue.Declare(queue="orders"), 1),
        frame.marshal(commands.Basic.Publish(routing_key="orders"), 1),
        content_frames(
            1, commands.Basic.Properties(headers={"JMSXGroupID": "k", "n": 1}), b"x" * 50, 4096
        ),
        frame.marshal(
            commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1
        ),
    ]
)


def _mqtt_stream(version: int) -> bytes:
    codec = MqttCodec(version=version)
    props = MqttProperties(
        correlation_data=b"c", user_properties=(("JMSXGroupID", "k"),), content_type="t"
    )
    return b"".join(
        [
            codec.send(Connect("fuzz", version, clean_start=True, keep_alive=30)),
            codec.send(Publish("orders/eu", b"payload", 1, packet_id=1, properties=props)),
            codec.send(Publish("orders/eu", b"", 0)),
        ]
    )


MQTT_STREAMS = [_mqtt_stream(MQTT_3_1_1), _mqtt_stream(MQTT_5)]
STOMP_CONNECT = b"CONNECT\naccept-version:1.0,1.1,1.2\nhost:h\nheart-beat:0,0\n\n\x00"
STOMP_STREAM = (
    STOMP_CONNECT
    + b"SEND\ndestination:/queue/orders\nJMSXGroupID:k\ncontent-length:5\nreceipt:1\n\nhello\x00"
    + b"BEGIN\ntransaction:t\n\n\x00"
    + b"SEND\ndestination:/topic/a.b\ntransaction:t\nAMQ_SCHEDULED_DELAY:10\n\nx\x00"
    + b"COMMIT\ntransaction:t\n\n\x00\n"
    + b"DISCONNECT\nreceipt:2\n\n\x00"
)


class _Collect(logging.Handler):
    """Every log record at ERROR or with a traceback: a listener that lets an exception
    other than a protocol error escape logs one of these."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.bad.append(record.getMessage())


async def _talk(port: int, data: bytes, *, answer: bool) -> bytes:
    """Send ``data``; collect what comes back until EOF or a short silence (a fuzzed frame
    may leave the server waiting for more). With ``answer``, wait for the first bytes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    got = bytearray()
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := await asyncio.wait_for(reader.read(65536), 5.0 if answer else 0.02):
                got += chunk
                if answer:
                    break
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return bytes(got)


def _fuzz_listener(make: Callable[[MemorySink], Listener], data: bytes, hello: bytes) -> None:
    async def scenario() -> tuple[list[str], bytes]:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, context: errors.append(str(context.get("message")))
        )
        collect = _Collect()
        logging.getLogger().addHandler(collect)
        listener = make(MemorySink())
        try:
            port = await listener.start(HOST, 0, None)
            await _talk(port, data, answer=False)
            alive = await _talk(port, hello, answer=True)
        finally:
            await listener.close()
            logging.getLogger().removeHandler(collect)
        return errors + collect.bad, alive

    problems, alive = asyncio.run(scenario())
    assert problems == []
    assert alive  # the listener still answers a well-formed handshake


def _amqp(sink: MemorySink) -> Any:
    return AmqpListener(sink, heartbeat=0)


def _mqtt(sink: MemorySink) -> Any:
    return MqttListener(sink)


def _stomp(sink: MemorySink) -> Any:
    return StompListener(sink)


@given(mutated([AMQP_STREAM]))
@fuzz_settings(60)
def test_mutated_amqp_bytes_get_a_clean_protocol_error_from_the_listener(data: bytes) -> None:
    _fuzz_listener(_amqp, data, AMQP_HEADER)


@given(mutated(MQTT_STREAMS))
@fuzz_settings(60)
def test_mutated_mqtt_bytes_get_a_clean_protocol_error_from_the_listener(data: bytes) -> None:
    _fuzz_listener(_mqtt, data, MQTT_STREAMS[0])


@given(mutated([STOMP_STREAM]))
@fuzz_settings(60)
def test_mutated_stomp_bytes_get_a_clean_protocol_error_from_the_listener(data: bytes) -> None:
    _fuzz_listener(_stomp, data, STOMP_CONNECT)
