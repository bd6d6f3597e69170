from __future__ import annotations

import pytest

from protocols._limits import MAX_DECIMAL_DIGITS, parse_decimal


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
