"""AMQP content properties → Publication → the properties of a delivery (mapping.py)."""

from __future__ import annotations

import datetime
from typing import Any

from pamqp import commands

from core.model import Message
from protocols.amqp.mapping import delivery_properties, to_publication

AT = datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.UTC)
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
    assert delivered.timestamp == datetime.datetime.fromtimestamp(1_800_000_000, datetime.UTC)
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
