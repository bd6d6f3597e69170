"""``storage.memory.MemoryStore`` that records the order of a group runtime's writes and
can make them fail, for the unit tests of ``gateway.runtime``.

``log`` names each write ("dispatch", "offsets", "keys", "assignments", "flows",
"dead_letter+<n>offsets") as it is made; ``fail = n`` makes the next n writes raise
StorageError before they change anything; ``hang`` makes every write wait forever (a
database that does not answer). ``letters`` keeps every dead letter written, and a stored
message whose payload is ``UNREADABLE`` reads back as a row that cannot be decoded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Final

from core.actions import DeadLetter, OffsetUpdate
from core.errors import StorageError
from core.model import Message
from storage.memory import MemoryStore

UNREADABLE: Final = b"unreadable"


class RecordingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.fail = 0
        self.hang = False
        self.letters: list[DeadLetter] = []

    async def _write(self, what: str) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            self.fail -= 1
            raise StorageError("database is down")
        self.log.append(what)

    async def record_dispatch(self, *args: Any, **kwargs: Any) -> None:
        await self._write("dispatch")
        await super().record_dispatch(*args, **kwargs)

    async def write_offsets(self, *args: Any, **kwargs: Any) -> None:
        await self._write("offsets")
        await super().write_offsets(*args, **kwargs)

    async def write_key_changes(self, *args: Any, **kwargs: Any) -> None:
        await self._write("keys")
        await super().write_key_changes(*args, **kwargs)

    async def write_assignments(self, *args: Any, **kwargs: Any) -> None:
        await self._write("assignments")
        await super().write_assignments(*args, **kwargs)

    async def write_flows(self, *args: Any, **kwargs: Any) -> None:
        await self._write("flows")
        await super().write_flows(*args, **kwargs)

    async def dead_letter(
        self,
        queue: str,
        group: str,
        letters: Sequence[DeadLetter],
        offsets: Sequence[OffsetUpdate],
        **kwargs: Any,
    ) -> list[list[int]]:
        await self._write(f"dead_letter+{len(offsets)}offsets")
        moved = await super().dead_letter(queue, group, letters, offsets, **kwargs)
        self.letters.extend(letters)
        return moved

    async def read_for_delivery(
        self, queue: str, pages: Sequence[tuple[int, int, int, int]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        found = await super().read_for_delivery(queue, pages)
        return {
            partition: (messages, frozenset(m.seq for m in messages if m.payload == UNREADABLE))
            for partition, (messages, _) in found.items()
        }
