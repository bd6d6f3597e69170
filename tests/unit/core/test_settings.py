"""The queue settings table covers the model, and checks settings from untyped sources."""

from __future__ import annotations

from dataclasses import fields

import pytest
import sqlalchemy as sa

from core.errors import InvalidArgument
from core.model import QueueConfig
from core.settings import INT32_MAX, INT64_MAX, QUEUE_SETTINGS, queue_settings
from storage.schema import kg_queues
from tests.support.settings_cases import LARGEST, OUT_OF_RANGE, WRONG_TYPES


def test_the_table_has_one_row_for_every_queue_setting() -> None:
    model = {f.name for f in fields(QueueConfig)} - {"name", "subscriptions"}
    assert [s.name for s in QUEUE_SETTINGS] == sorted(
        model, key=[s.name for s in QUEUE_SETTINGS].index
    )
    assert {s.name for s in QUEUE_SETTINGS} == model
    assert all(s.help for s in QUEUE_SETTINGS)


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
    assert queue_settings({"ttl": None, "dead_letter_queue": None}) == {
        "ttl": None,
        "dead_letter_queue": None,
    }
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
        {"window": None},
        {"dead_letter_expired": 1},
        {"key_from": 3},
        {"no_such_setting": 1},
    ],
)
def test_queue_settings_refuse_a_wrong_type_naming_the_setting(values: dict[str, object]) -> None:
    (name,) = values
    with pytest.raises(InvalidArgument, match=name):
        queue_settings(values)


@pytest.mark.parametrize(("name", "value", "kind"), WRONG_TYPES)
def test_a_queue_config_refuses_a_wrong_type_naming_the_setting_and_its_type(
    name: str, value: object, kind: str
) -> None:
    # Every interface (native DECLARE_QUEUE, the SDK, AMQP, the CLI, HTTP) makes a
    # QueueConfig: the type check there is the one they all share.
    with pytest.raises(InvalidArgument, match=f"^{name} must be of type {kind}"):
        QueueConfig("q", **{name: value})  # type: ignore[arg-type]


def test_a_queue_config_takes_an_int_where_a_float_setting_is_expected_as_a_float() -> None:
    config = QueueConfig("q", rebalance_delay=5, ttl=30, backoff_multiplier=2)
    assert (config.rebalance_delay, config.ttl, config.backoff_multiplier) == (5.0, 30.0, 2.0)
    assert all(
        type(v) is float for v in (config.rebalance_delay, config.ttl, config.backoff_multiplier)
    )


@pytest.mark.parametrize(("name", "value", "bounds"), OUT_OF_RANGE)
def test_a_queue_config_refuses_an_integer_outside_its_range_naming_the_range(
    name: str, value: int, bounds: str
) -> None:
    with pytest.raises(InvalidArgument, match=f"^{name} must be {bounds}$"):
        QueueConfig("q", **{name: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=f"^{name} must be {bounds}$"):
        queue_settings({name: value})


def test_every_integer_setting_has_a_range_its_column_holds_on_both_databases() -> None:
    # An INTEGER column is 32 bits on PostgreSQL (SQLite's hold 64), a BIGINT 64.
    for setting in QUEUE_SETTINGS:
        if setting.kind is not int:
            continue
        column = kg_queues.c["window_size" if setting.name == "window" else setting.name]
        big = isinstance(column.type, sa.BigInteger)
        assert setting.minimum is not None and setting.maximum is not None, setting.name
        assert 0 <= setting.minimum <= setting.maximum <= (INT64_MAX if big else INT32_MAX)
    assert QueueConfig("q", **LARGEST).max_depth_bytes == INT64_MAX  # type: ignore[arg-type]
