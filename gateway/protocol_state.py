"""The Sink calls through which the listeners keep protocol state in SQL (AMQP exchanges,
MQTT sessions), so that it survives a gateway restart or failover. Mixed into Broker."""

from __future__ import annotations

from collections.abc import Callable

from storage.store import SqlStore


class ProtocolState:
    _store: SqlStore
    clock: Callable[[], float]

    async def amqp_exchanges(self) -> dict[str, str]:
        return await self._store.amqp_exchanges()

    async def save_amqp_exchange(self, name: str, type_name: str | None) -> None:
        await self._store.save_amqp_exchange(name, type_name)

    async def mqtt_session(self, client_id: str) -> set[int] | None:
        return await self._store.mqtt_session(client_id, now=self.clock())

    async def save_mqtt_session(self, client_id: str, *, expires_in: float | None) -> None:
        expires_at = None if expires_in is None else self.clock() + expires_in
        await self._store.save_mqtt_session(client_id, expires_at=expires_at)

    async def mqtt_released(self, client_id: str, packet_ids: frozenset[int]) -> None:
        await self._store.mqtt_released(client_id, packet_ids)

    async def drop_mqtt_session(self, client_id: str) -> None:
        await self._store.drop_mqtt_session(client_id)


__all__ = ["ProtocolState"]
