"""The one parser of delay headers (AMQP/MQTT 5 ``x-delay``, STOMP ``AMQ_SCHEDULED_DELAY``)."""

from __future__ import annotations

import decimal

import pytest

from core.errors import InvalidArgument
from core.schedule import DELAY_HEADER, delay_seconds


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (1500, 1.5),
        (0, 0.0),
        (2.5, 0.0025),
        (decimal.Decimal("1000"), 1.0),
        ("1500", 1.5),
        ("0", 0.0),
        ("250.5", 0.2505),
    ],
)
def test_milliseconds_in_any_header_type_become_seconds(value: object, seconds: float) -> None:
    assert delay_seconds(DELAY_HEADER, value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    [
        -1,
        "-1",
        -0.5,
        float("nan"),
        float("inf"),
        decimal.Decimal("NaN"),
        decimal.Decimal("sNaN"),
        10**400,
        True,
        b"1500",
        "",
        "1e3",
        " 15",
        "soon",
        "nan",
        None,
    ],
)
def test_anything_but_a_finite_non_negative_number_is_refused_naming_the_header(
    value: object,
) -> None:
    with pytest.raises(InvalidArgument, match="invalid x-delay"):
        delay_seconds(DELAY_HEADER, value)
