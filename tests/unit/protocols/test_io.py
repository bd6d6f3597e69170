"""The listeners' shared publish step: one transaction, one by one only when a
publication spoils the batch, nothing after a refusal where the protocol stops there."""

from __future__ import annotations

from core.errors import MessageTooLarge, StorageError
from core.model import Publication, QueueConfig
from protocols._io import publish_in_order
from protocols.sink import Principal
from tests.support.memory_sink import MemorySink

ME = Principal(None, "test")


async def _sink() -> MemorySink:
    sink = MemorySink()
    await sink.declare_queue(ME, QueueConfig("q", max_message_size=100))
    return sink


def _pubs(count: int, too_large: int | None = None) -> list[Publication]:
    return [
        Publication(b"x" * 200 if i == too_large else b"%d" % i, queue="q") for i in range(count)
    ]


async def test_an_accepted_batch_is_stored_whole() -> None:
    sink = await _sink()
    assert await publish_in_order(sink, ME, _pubs(2), stop_at_refusal=False) == [None, None]
    assert [s.publication.payload for s in sink.stored] == [b"0", b"1"]


async def test_a_refused_publication_fails_alone_or_stops_the_rest() -> None:
    sink = await _sink()
    outcomes = await publish_in_order(sink, ME, _pubs(4, too_large=2), stop_at_refusal=False)
    assert outcomes[:2] == [None, None] and outcomes[3] is None
    assert isinstance(outcomes[2], MessageTooLarge)
    assert [s.publication.payload for s in sink.stored] == [b"0", b"1", b"3"]
    stopping = await _sink()
    outcomes = await publish_in_order(stopping, ME, _pubs(4, too_large=2), stop_at_refusal=True)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], MessageTooLarge)
    assert len(outcomes) == 3  # the fourth was not tried
    assert [s.publication.payload for s in stopping.stored] == [b"0", b"1"]


async def test_a_storage_failure_fails_the_whole_batch_without_retrying() -> None:
    sink = await _sink()
    sink.fail_writes = True
    outcomes = await publish_in_order(sink, ME, _pubs(2), stop_at_refusal=False)
    assert len(outcomes) == 2 and all(isinstance(o, StorageError) for o in outcomes)
    assert sink.stored == []
