"""A ``protocols.sink.Sink`` that accepts everything at once, so a benchmark measures a
protocol listener alone, without storage."""

from __future__ import annotations

from collections.abc import Awaitable, Collection, Sequence

from core.errors import KeygateError, PermissionDenied
from core.model import DEFAULT_MAX_MESSAGE_SIZE, Publication, QueueConfig
from protocols.sink import BindRequest, BindResult, FlowOutput, Principal, Receipt, Settle


class NullSink:
    """Accepts every publish at once (measures the listener alone); consuming is refused."""

    max_message_size = DEFAULT_MAX_MESSAGE_SIZE
    blocked = False

    async def authenticate(
        self,
        username: str | None,
        password: str | None,
        *,
        protocol: str,
        client_id: str | None,
        peer: str | None = None,
        certificate_user: str | None = None,
    ) -> Principal:
        return Principal(username, protocol, client_id)

    def may_administer(self, principal: Principal) -> bool:
        return True

    async def publish(
        self,
        principal: Principal,
        publication: Publication,
        *,
        qos2_packet_id: int | None = None,
    ) -> Receipt:
        return Receipt(("m",), (publication.queue or "",))

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        return _receipts(publications)

    def publish_each(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> Awaitable[list[Receipt | KeygateError]]:
        return self._each(publications)

    async def _each(self, publications: Sequence[Publication]) -> list[Receipt | KeygateError]:
        return [*_receipts(publications)]

    async def declare_queue(
        self,
        principal: Principal,
        config: QueueConfig,
        *,
        passive: bool = False,
        exist_ok: bool = True,
        given: Collection[str] | None = None,
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

    async def bind(
        self, principal: Principal, request: BindRequest, output: FlowOutput
    ) -> BindResult:
        raise PermissionDenied("the null sink has nothing to consume")

    def settle(self, principal: Principal, flow_id: str, event: Settle) -> None:
        return None

    async def amqp_exchanges(self) -> dict[str, str]:
        return {}

    async def save_amqp_exchange(self, name: str, type_name: str | None) -> None:
        return None

    async def mqtt_session(self, client_id: str) -> set[int] | None:
        return None

    async def save_mqtt_session(self, client_id: str, *, expires_in: float | None) -> None:
        return None

    async def mqtt_released(self, client_id: str, packet_ids: frozenset[int]) -> None:
        return None

    async def drop_mqtt_session(self, client_id: str) -> None:
        return None


def _receipts(publications: Sequence[Publication]) -> list[Receipt]:
    return [Receipt(("m",), (p.queue or "",)) for p in publications]
