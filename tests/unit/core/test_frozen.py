"""``frozen`` value classes, and ``bare`` + ``__init__`` building one as the class call
does (defaults, default factories and ``__post_init__`` included)."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from core.frozen import bare
from core.model import Message, Publication


def test_bare_then_init_builds_what_the_class_call_builds() -> None:
    made = bare(Publication)
    Publication.__init__(made, payload=b"x", queue="q", key="k")
    assert made == Publication(payload=b"x", queue="q", key="k")
    assert made.properties == {} and made.properties is not Publication(b"x", "q").properties


def test_bare_then_init_runs_post_init_checks() -> None:
    made = bare(Publication)
    with pytest.raises(InvalidArgument, match="exactly one"):
        Publication.__init__(made, payload=b"x")


def test_a_bare_message_measures_its_size_once_initialised() -> None:
    made = bare(Message)
    Message.__init__(made, message_id="id", queue="q", partition=0, seq=1, key="k", payload=b"xy")
    assert made == Message("id", "q", 0, 1, "k", b"xy")
    assert made.size == Message("id", "q", 0, 1, "k", b"xy").size
