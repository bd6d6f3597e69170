"""Where a message's partition key comes from (DESIGN.md §3.2): first found, property
QUEUE_PARTITION_KEY, property JMSXGroupID, the key field (native, HTTP), AMQP app_id when
the queue says so, the queue's topic:N rule."""

from __future__ import annotations

import pytest

from core.keys import resolve_key
from core.model import Publication, QueueConfig

QUEUE = QueueConfig("q", partitions=16)


@pytest.mark.parametrize(
    ("key", "properties", "expected"),
    [
        ("alpha", {"QUEUE_PARTITION_KEY": "bravo"}, "bravo"),
        ("alpha", {"JMSXGroupID": "bravo"}, "bravo"),
        ("alpha", {"JMSXGroupID": "charlie", "QUEUE_PARTITION_KEY": "bravo"}, "bravo"),
        (None, {"JMSXGroupID": "charlie", "QUEUE_PARTITION_KEY": "bravo"}, "bravo"),
        (None, {"JMSXGroupID": "charlie"}, "charlie"),
        ("alpha", {"other": "bravo"}, "alpha"),
        (None, {}, None),
    ],
)
def test_the_key_properties_come_before_the_key_field(
    key: str | None, properties: dict[str, str], expected: str | None
) -> None:
    publication = Publication(b"x", queue="q", key=key, properties=properties)  # type: ignore[arg-type]
    assert resolve_key(publication, QUEUE) == expected


def test_the_key_field_comes_before_the_queues_own_rules() -> None:
    by_app = QueueConfig("q", key_from="app_id")
    assert resolve_key(Publication(b"x", queue="q", key="k", app_id="a"), by_app) == "k"
    assert resolve_key(Publication(b"x", queue="q", app_id="a"), by_app) == "a"
    by_topic = QueueConfig("q", key_from="topic:1")
    assert resolve_key(Publication(b"x", topic="t/level", key="k"), by_topic) == "k"
    assert resolve_key(Publication(b"x", topic="t/level"), by_topic) == "level"
