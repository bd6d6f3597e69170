from __future__ import annotations

import pytest

from core.topics import matches
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError, AmqpConnectionError
from protocols.amqp.exchanges import Exchanges, binding_pattern, publish_topic


@pytest.fixture
def exchanges() -> Exchanges:
    return Exchanges()


@pytest.mark.parametrize(
    ("binding", "routing", "expected"),
    [
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.b.c", False),
        ("a.#", "a.b.c", True),
        ("a.#", "a", True),
        ("#", "x.y", True),
        ("sensors.room1", "sensors.room1", True),
        ("sensors.room1", "sensors.room2", False),
    ],
)
def test_amq_topic_bindings_match_like_rabbitmq(
    exchanges: Exchanges, binding: str, routing: str, expected: bool
) -> None:
    exchange = exchanges.get("amq.topic")
    topic = publish_topic(exchange, routing)
    assert topic is not None
    assert matches(binding_pattern(exchange, binding), topic) is expected


def test_amq_topic_shares_the_mqtt_and_stomp_topic_space(exchanges: Exchanges) -> None:
    exchange = exchanges.get("amq.topic")
    assert publish_topic(exchange, "sensors.room1.temp") == "sensors/room1/temp"
    assert binding_pattern(exchange, "sensors.*.#") == "sensors/+/#"


def test_wildcard_characters_in_an_amq_topic_routing_key_are_unroutable(
    exchanges: Exchanges,
) -> None:
    exchange = exchanges.get("amq.topic")
    assert publish_topic(exchange, "a.+") is None
    assert publish_topic(exchange, "") is None


def test_declared_exchanges_have_their_own_namespace(exchanges: Exchanges) -> None:
    topic = exchanges.declare("events", "topic", passive=False, create=True)
    direct = exchanges.declare("rpc", "direct", passive=False, create=True)
    fanout = exchanges.declare("all", "fanout", passive=False, create=True)
    assert publish_topic(topic, "order.created") == "$amqp/events/order/created"
    assert binding_pattern(topic, "order.*") == "$amqp/events/order/+"
    assert publish_topic(direct, "a.b/c+d") == "$amqp/rpc/a.b%2Fc%2Bd"
    assert binding_pattern(direct, "a.b/c+d") == "$amqp/rpc/a.b%2Fc%2Bd"
    assert publish_topic(fanout, "whatever") == binding_pattern(fanout, "ignored") == "$amqp/all"


def test_private_namespaces_are_not_matched_by_a_catch_all_subscription(
    exchanges: Exchanges,
) -> None:
    topic = publish_topic(exchanges.declare("events", "topic", passive=False, create=True), "x")
    assert topic is not None and not matches("#", topic)


def test_hash_before_the_last_word_is_refused(exchanges: Exchanges) -> None:
    with pytest.raises(AmqpChannelError) as info:
        binding_pattern(exchanges.get("amq.topic"), "#.error")
    assert info.value.reply_code is ReplyCode.PRECONDITION_FAILED


def test_default_exchange_cannot_be_bound(exchanges: Exchanges) -> None:
    with pytest.raises(AmqpChannelError) as info:
        binding_pattern(exchanges.get(""), "q")
    assert info.value.reply_code is ReplyCode.ACCESS_REFUSED


def test_builtin_exchanges_cannot_be_deleted_or_reserved_names_declared(
    exchanges: Exchanges,
) -> None:
    with pytest.raises(AmqpChannelError) as deleted:
        exchanges.delete("amq.topic")
    with pytest.raises(AmqpChannelError) as declared:
        exchanges.declare("amq.custom", "topic", passive=False, create=True)
    assert deleted.value.reply_code is declared.value.reply_code is ReplyCode.ACCESS_REFUSED


def test_passive_declare_of_a_missing_exchange_is_not_found(exchanges: Exchanges) -> None:
    with pytest.raises(AmqpChannelError) as info:
        exchanges.declare("missing", "topic", passive=True, create=True)
    assert info.value.reply_code is ReplyCode.NOT_FOUND


def test_unknown_exchange_type_is_command_invalid(exchanges: Exchanges) -> None:
    with pytest.raises(AmqpConnectionError) as info:
        exchanges.declare("h", "bogus", passive=False, create=True)
    assert info.value.reply_code is ReplyCode.COMMAND_INVALID


def test_delayed_message_exchange_routes_as_its_x_delayed_type(exchanges: Exchanges) -> None:
    delayed = exchanges.declare(
        "later",
        "x-delayed-message",
        passive=False,
        create=True,
        arguments={"x-delayed-type": "topic"},
    )
    assert publish_topic(delayed, "a.b") == "$amqp/later/a/b"
    assert (
        exchanges.declare(
            "later",
            "x-delayed-message",
            passive=False,
            create=True,
            arguments={"x-delayed-type": "topic"},
        )
        is delayed
    )
    with pytest.raises(AmqpChannelError) as plain:
        exchanges.declare("later", "topic", passive=False, create=True)
    with pytest.raises(AmqpChannelError, match="inequivalent arg 'x-delayed-type'"):
        exchanges.declare(
            "later",
            "x-delayed-message",
            passive=False,
            create=True,
            arguments={"x-delayed-type": "direct"},
        )
    with pytest.raises(AmqpChannelError) as untyped:
        exchanges.declare("other", "x-delayed-message", passive=False, create=True)
    assert plain.value.reply_code is untyped.value.reply_code is ReplyCode.PRECONDITION_FAILED


def test_deleting_a_missing_exchange_is_ok(exchanges: Exchanges) -> None:
    exchanges.delete("never-declared")
    assert exchanges.find("never-declared") is None


def test_deleted_exchange_is_gone(exchanges: Exchanges) -> None:
    exchanges.declare("tmp", "fanout", passive=False, create=True)
    exchanges.delete("tmp")
    with pytest.raises(AmqpChannelError):
        exchanges.get("tmp")
