"""``keygate group reset --to`` positions are parsed in one place."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from core.model import ResetKind, ResetPosition


def test_every_documented_position_parses() -> None:
    assert ResetPosition.parse("earliest").kind is ResetKind.EARLIEST
    assert ResetPosition.parse("latest").kind is ResetKind.LATEST
    assert ResetPosition.parse("seq:0=5,3=1").seqs == {0: 5, 3: 1}
    moment = ResetPosition.parse("time:2026-11-22T10:00:00+01:00")
    assert (moment.kind, moment.time) == (ResetKind.TIME, 1795338000.0)


@pytest.mark.parametrize(
    "text", ["", "seq:", "seq:a=1", "seq:1=0", "seq:1", "time:yesterday", "time:2026-11-22", "x"]
)
def test_a_bad_position_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(InvalidArgument):
        ResetPosition.parse(text)
