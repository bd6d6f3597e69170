"""Intake: a stopped connection reads as if its peer had closed, at once or in the read
under way, without touching the stream; a cancel from elsewhere still cancels."""

from __future__ import annotations

import asyncio

import pytest

from protocols._intake import Intake


async def test_a_read_under_way_ends_as_at_eof_when_stopped_and_the_stream_is_left_alone() -> None:
    stream = asyncio.StreamReader()
    intake = Intake(stream)
    stream.feed_data(b"first")
    assert await intake.read(100) == b"first"
    reading = asyncio.create_task(intake.read(100))
    await asyncio.sleep(0)  # the read waits for data
    intake.stop()
    assert await reading == b""
    assert await intake.read(100) == b""  # and every read after it
    stream.feed_data(b"late")  # bytes arriving later are no error: they are never read
    assert not stream.at_eof()


async def test_a_cancel_from_elsewhere_still_cancels_the_reader() -> None:
    intake = Intake(asyncio.StreamReader())
    reading = asyncio.create_task(intake.read(100))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    # Stopped and cancelled together: the cancel wins.
    other = Intake(asyncio.StreamReader())
    reading = asyncio.create_task(other.read(100))
    await asyncio.sleep(0)
    other.stop()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
