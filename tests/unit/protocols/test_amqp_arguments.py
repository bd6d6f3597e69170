"""Queue.Declare x-arguments → QueueConfig, and RabbitMQ's re-declare equivalence rule."""

from __future__ import annotations

from typing import Any

import pytest

from core.model import QueueConfig
from protocols.amqp.arguments import check_equivalent, declared_queue
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError


def test_rabbitmq_arguments_map_onto_keygate_settings_and_remember_their_names() -> None:
    declared = declared_queue(
        "jobs",
        {
            "x-message-ttl": 1500,
            "x-max-length": 10,
            "x-max-length-bytes": 4096,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": b"parked",
            "x-queue-type": "quorum",
            "x-overflow": "reject-publish",
            "x-expires": 1000,
            "x-single-active-consumer": False,
            "x-max-priority": 10,
        },
    )
    config = declared.config
    assert (config.ttl, config.max_depth_messages, config.max_depth_bytes) == (1.5, 10, 4096)
    assert config.dead_letter_queue == "parked"
    assert declared.given == {
        "ttl": "x-message-ttl",
        "max_depth_messages": "x-max-length",
        "max_depth_bytes": "x-max-length-bytes",
        "dead_letter_queue": "x-dead-letter-routing-key",
    }


@pytest.mark.parametrize(
    "arguments",
    [
        {"x-partitions": "8"},
        {"x-message-ttl": 0},
        {"x-max-length": True},
        {"x-queue-type": "stream"},
        {"x-queue-type": 3},
        {"x-overflow": "drop-head"},
        {"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "q"},
        {"x-dead-letter-exchange": ""},
        {"x-dead-letter-routing-key": "q"},
        {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "jobs"},
        {"x-expires": -5},
    ],
)
def test_an_argument_keygate_cannot_honour_is_406(arguments: dict[str, Any]) -> None:
    with pytest.raises(AmqpChannelError) as refused:
        declared_queue("jobs", arguments)
    assert refused.value.reply_code is ReplyCode.PRECONDITION_FAILED


def test_a_redeclare_is_compared_only_on_the_settings_it_names() -> None:
    stored = QueueConfig("jobs", partitions=16, max_depth_messages=100, ttl=60.0)
    for same in ({}, {"x-partitions": 16}, {"x-message-ttl": 60_000, "x-max-length": 100}):
        wanted = declared_queue("jobs", same)
        check_equivalent(stored, wanted.config, wanted.given)
    wanted = declared_queue("jobs", {"x-message-ttl": 30_000})
    with pytest.raises(AmqpChannelError, match="inequivalent arg 'x-message-ttl'") as refused:
        check_equivalent(stored, wanted.config, wanted.given)
    assert refused.value.reply_code is ReplyCode.PRECONDITION_FAILED


def test_the_default_dead_letter_queue_equals_its_explicit_name() -> None:
    wanted = declared_queue(
        "jobs", {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "jobs.dlq"}
    )
    check_equivalent(QueueConfig("jobs"), wanted.config, wanted.given)
