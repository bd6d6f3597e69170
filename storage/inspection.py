"""Reading the inspection views (storage.schema.VIEWS) for the admin API: the same rows a
user gets with plain SQL, as dicts."""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa

from core.errors import QueueNotFound
from storage.base import StoreBase

_QUEUE_STATS: Final = sa.text(
    "SELECT depth, bytes, in_flight, dead_letters FROM kg_queue_stats WHERE queue = :queue"
)
_PARTITION_STATUS: Final = sa.text(
    "SELECT * FROM kg_partition_status WHERE queue = :queue ORDER BY group_name, partition"
)
_GROUP_LAG: Final = sa.text("SELECT * FROM kg_group_lag WHERE queue = :queue ORDER BY group_name")


class InspectionOps(StoreBase):
    async def queue_stats(self, queue: str) -> dict[str, int]:
        """``kg_queue_stats`` of one queue: depth, bytes, in_flight, dead_letters."""
        async with self.transaction() as conn:
            row = (await conn.execute(_QUEUE_STATS, {"queue": queue})).mappings().first()
        if row is None:
            raise QueueNotFound(queue)
        return {name: int(value) for name, value in row.items()}

    async def partition_status(self, queue: str) -> list[dict[str, Any]]:
        """``kg_partition_status`` rows of every group of the queue, by group and partition."""
        async with self.transaction() as conn:
            result = await conn.execute(_PARTITION_STATUS, {"queue": queue})
            return [dict(row) for row in result.mappings()]

    async def group_lag(self, queue: str) -> list[dict[str, Any]]:
        """``kg_group_lag`` rows of the queue's groups."""
        async with self.transaction() as conn:
            result = await conn.execute(_GROUP_LAG, {"queue": queue})
            return [dict(row) for row in result.mappings()]
