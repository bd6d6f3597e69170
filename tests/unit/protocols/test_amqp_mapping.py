"""AMQP content properties → Publication → the properties of a delivery (mapping.py)."""

from __future__ import annotations

import datetime
from typing import Any

from pamqp import commands

from core.model import Message
from protocols.amqp.fieldtables import Timestamp
from protocols.amqp.mapping import TIMESTAMP, delivery_properties, to_publication

AT = Timestamp(1_700_000_000)  # as hotframes decodes it
BASIC: dict[str, Any] = {
    "message_id": "biz-1",
    "app_id": "myapp",
    "message_type": "t.x",
    "user_id": "guest",
    "content_encoding": "gzip",
    "delivery_mode": 1,
    "priority": 3,
    "timestamp": AT,
    "content_type": "text/plain",
    "correlation_id": "c1",
    "reply_to": "r1",
}


def _stored(properties: commands.Basic.Properties, **fields: Any) -> Message:
    """What the store would hold of a publish of ``properties`` (seq 7, partition 1)."""
    p = to_publication(properties, b"x", queue="q", topic=None, producer="amqp:t")
    return Message(
        "kg-1",
        "q",
        1,
        7,
        "k",
        b"x",
        p.properties,
        publish_time=1_800_000_000.25,
        dedup_id=p.dedup_id,
        content_type=p.content_type,
        correlation_id=p.correlation_id,
        reply_to=p.reply_to,
        **fields,
    )


def test_every_basic_property_survives_a_publish_and_a_delivery() -> None:
    published = commands.Basic.Properties(headers={"h": 1}, **BASIC)
    message = _stored(published, expire_at=1_800_000_060.25)
    delivered = delivery_properties(message, delivery_count=2)
    assert {name: getattr(delivered, name) for name in BASIC} == BASIC
    assert delivered.expiration == "60000"
    assert delivered.headers == {
        "h": 1,
        "x-partition": 1,
        "x-seq": 7,
        "x-delivery-count": 2,
        "x-message-id": "kg-1",
        "JMSXGroupID": "k",
    }


def test_without_basic_properties_a_delivery_has_keygate_s_id_time_and_durability() -> None:
    delivered = delivery_properties(_stored(commands.Basic.Properties()), delivery_count=1)
    assert (delivered.message_id, delivered.delivery_mode, delivered.expiration) == (
        "kg-1",
        2,
        None,
    )
    assert delivered.timestamp == 1_800_000_000
    assert delivered.app_id is None and delivered.priority is None


def test_stored_properties_win_and_the_gateway_s_values_move_aside() -> None:
    headers = {"x-delivery-count": 3, "x-partition": "p", "amqp.priority": 300}
    delivered = delivery_properties(
        _stored(commands.Basic.Properties(headers=headers)), delivery_count=1
    )
    assert delivered.priority is None  # 300 does not fit an octet: stays a header
    assert delivered.headers == {
        **headers,
        "x-keygate-delivery-count": 1,
        "x-keygate-partition": 1,
        "x-seq": 7,
        "x-message-id": "kg-1",
        "JMSXGroupID": "k",
    }


def test_any_64_bit_timestamp_is_stored_and_delivered_unchanged() -> None:
    """Seconds, milliseconds, 2^62, 2^64 - 1: as RabbitMQ, never rescaled. Properties hold
    int64, so a value past it is stored as its decimal text and still delivered as the
    timestamp it was; a header of type 'T' is stored as its integer."""
    for value, stored in (
        (1_700_000_000_000, 1_700_000_000_000),
        (2**62, 2**62),
        (2**64 - 1, str(2**64 - 1)),
    ):
        published = commands.Basic.Properties(
            timestamp=Timestamp(value), headers={"sent": Timestamp(value)}
        )
        message = _stored(published)
        assert (message.properties[TIMESTAMP], message.properties["sent"]) == (stored, stored)
        assert delivery_properties(message, delivery_count=1).timestamp == value


def test_a_timestamp_pamqp_decoded_is_stored_as_its_seconds() -> None:
    """A frame hotframes leaves to pamqp (an unusual encoding) has datetimes."""
    when = datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.UTC)
    message = _stored(commands.Basic.Properties(timestamp=when, headers={"t": when}))
    assert (message.properties[TIMESTAMP], message.properties["t"]) == (1_700_000_000,) * 2
