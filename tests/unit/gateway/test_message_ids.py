"""Message ids: UUID-formatted, unique, and sorted by publish time (DESIGN.md §2)."""

from __future__ import annotations

import uuid

from gateway.ids import new_message_id


def test_ids_are_uuids_that_sort_by_publish_millisecond() -> None:
    ids = [new_message_id(1_700_000_000.0 + i / 1000) for i in range(50)]
    assert ids == sorted(ids)
    assert all(str(uuid.UUID(i)) == i for i in ids)


def test_ids_of_the_same_millisecond_do_not_collide() -> None:
    ids = {new_message_id(1_700_000_000.0) for _ in range(20_000)}
    assert len(ids) == 20_000
