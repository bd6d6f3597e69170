"""A ``protocols.sink.Sink`` that accepts everything at once, so a benchmark measures a
protocol listener alone, without storage."""

from __future__ import annotations

from collections.abc import Sequence

from core.model import DEFAULT_MAX_MESSAGE_SIZE, Publication, QueueConfig
from protocols.sink import Principal, Receipt


class NullSink:
    """Accepts everything at once: measures the listener alone."""

    max_message_size = DEFAULT_MAX_MESSAGE_SIZE
    blocked = False

    async def authenticate(
        self, username: str | None, password: str | None, *, protocol: str, client_id: str | None
    ) -> Principal:
        return Principal(username, protocol, client_id)

    async def publish(self, principal: Principal, publication: Publication) -> Receipt:
        return Receipt(("m",), (publication.queue or "",))

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        return [Receipt(("m",), (p.queue or "",)) for p in publications]

    async def declare_queue(
        self, principal: Principal, config: QueueConfig, *, passive: bool = False
    ) -> QueueConfig:
        return config

    async def delete_queue(self, principal: Principal, name: str) -> int:
        return 0

    async def purge_queue(self, principal: Principal, name: str) -> int:
        return 0

    async def queue_depth(self, principal: Principal, name: str) -> int:
        return 0

    async def subscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        return None

    async def unsubscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        return None
