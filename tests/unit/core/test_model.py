"""Queue settings from untyped sources (JSON, TOML) are checked against the model's types."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from core.model import QueueConfig, queue_settings


def test_queue_settings_accept_each_type_and_turn_lists_into_tuples() -> None:
    settings = queue_settings(
        {"partitions": 4, "ttl": 30, "subscriptions": ["a/#"], "dead_letter_expired": True}
    )
    assert settings == {
        "partitions": 4,
        "ttl": 30.0,
        "subscriptions": ("a/#",),
        "dead_letter_expired": True,
    }
    assert QueueConfig("q", **settings).subscriptions == ("a/#",)  # type: ignore[arg-type]


def test_queue_settings_take_none_only_where_a_setting_is_optional() -> None:
    assert queue_settings({"ttl": None}) == {"ttl": None}
    with pytest.raises(InvalidArgument, match="partitions"):
        queue_settings({"partitions": None})


@pytest.mark.parametrize(
    "values",
    [
        {"partitions": "4"},
        {"partitions": True},
        {"partitions": 1.5},
        {"ttl": "soon"},
        {"ttl": [1]},
        {"subscriptions": None},
        {"subscriptions": [1]},
        {"dead_letter_expired": 1},
        {"key_from": 3},
        {"no_such_setting": 1},
    ],
)
def test_queue_settings_refuse_a_wrong_type_naming_the_setting(values: dict[str, object]) -> None:
    (name,) = values
    with pytest.raises(InvalidArgument, match=name):
        queue_settings(values)
