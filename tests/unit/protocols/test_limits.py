from __future__ import annotations

import asyncio

import pytest

from core.errors import ConnectionLimitReached
from protocols._limits import MAX_DECIMAL_DIGITS, ByteBudget, ConnectionCounter, parse_decimal


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("0", 0), ("007", 7), ("9" * MAX_DECIMAL_DIGITS, int("9" * MAX_DECIMAL_DIGITS))],
)
def test_plain_ascii_decimals_are_read(raw: str, expected: int) -> None:
    assert parse_decimal(raw) == expected


@pytest.mark.parametrize(
    "raw", ["", " 1", "1 ", "-1", "+1", "1.0", "1e3", "²", "١٢", "9" * (MAX_DECIMAL_DIGITS + 1)]
)
def test_anything_but_a_short_ascii_decimal_is_refused(raw: str) -> None:
    assert parse_decimal(raw) is None


def test_a_value_over_the_maximum_is_refused() -> None:
    assert parse_decimal("1001", maximum=1000) is None
    assert parse_decimal("1000", maximum=1000) == 1000


def test_the_counter_refuses_over_the_total_and_per_user_and_forgets_on_release() -> None:
    counter = ConnectionCounter(max_connections=3, max_connections_per_user=1)
    alice = counter.open("native")
    alice.login("alice")
    with pytest.raises(ConnectionLimitReached, match="1 per user"):
        counter.open("native").login("alice")
    # The refused one is still an open socket until it is released.
    assert counter.total == 2
    extra = counter.open("native")
    with pytest.raises(ConnectionLimitReached, match="3 connections"):
        counter.open("native").login("bob")
    alice.release()
    alice.release()
    assert counter.total == 3
    assert counter.per_user == {}
    extra.login("alice")
    assert counter.per_user == {"alice": 1}


async def test_the_budget_waits_for_room_but_lets_one_oversized_item_through() -> None:
    budget = ByteBudget(10)
    await budget.acquire(25)
    waiting = asyncio.ensure_future(budget.acquire(5))
    await asyncio.sleep(0)
    assert not waiting.done()
    budget.release(25)
    await asyncio.wait_for(waiting, 1)
    assert (budget.held, budget.peak) == (5, 25)


def test_open_connections_are_counted_by_protocol_until_released() -> None:
    counter = ConnectionCounter()
    first, second = counter.open("mqtt"), counter.open("mqtt")
    third = counter.open("amqp")
    assert counter.per_protocol == {"mqtt": 2, "amqp": 1}
    first.release()
    first.release()  # a second release changes nothing
    third.release()
    assert counter.per_protocol == {"mqtt": 1, "amqp": 0}
    second.release()
    assert counter.total == 0
