"""Protocol state that must survive a gateway restart or failover, kept in SQL rather than
in listener memory: AMQP exchanges (their bindings are already queue subscriptions) and
MQTT sessions (the QoS 2 packet ids stored and waiting for PUBREL, and when the session
expires once its client is gone).

These writes are fenced like every other (StoreBase.transaction): a gateway that lost the
lease cannot overwrite the new active gateway's sessions.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from storage.base import StoreBase
from storage.schema import kg_amqp_exchanges, kg_mqtt_sessions
from storage.statements import upsert


def _encode_ids(packet_ids: frozenset[int]) -> str:
    return ",".join(str(i) for i in sorted(packet_ids))


def _decode_ids(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part}


class ProtocolStateOps(StoreBase):
    # An MQTT session's reads and writes come with each connect and disconnect, a storm of
    # them with a reconnecting fleet: on the writer thread, each in one hand-over.
    # Through the async engine, on SQLite, each held the write lock for an event-loop
    # round trip per step (2.6 s under a publish flood) and the appends waited behind it.
    async def amqp_exchanges(self) -> dict[str, str]:
        """Every declared AMQP exchange: name -> type."""
        e = kg_amqp_exchanges
        async with self.transaction(fenced=False) as conn:
            return {row.name: row.type for row in await conn.execute(sa.select(e))}

    async def save_amqp_exchange(self, name: str, type_name: str | None) -> None:
        """Store a declared exchange, or delete it (``type_name`` None)."""
        e = kg_amqp_exchanges
        async with self.transaction() as conn:
            if type_name is None:
                await conn.execute(sa.delete(e).where(e.c.name == name))
            else:
                stmt = upsert(conn, e, ("name",), ("type",))
                await conn.execute(stmt, [{"name": name, "type": type_name}])

    async def mqtt_session(self, client_id: str, *, now: float) -> set[int] | None:
        """The QoS 2 packet ids a stored, unexpired session waits PUBREL for; None when
        no such session is stored."""
        s = kg_mqtt_sessions
        query = sa.select(s.c.qos2_waiting).where(
            s.c.client_id == client_id, sa.or_(s.c.expires_at.is_(None), s.c.expires_at > now)
        )
        text = await self.write(lambda conn: conn.execute(query).scalar_one_or_none(), fenced=False)
        return None if text is None else _decode_ids(text)

    async def save_mqtt_session(self, client_id: str, *, expires_at: float | None) -> None:
        """Store that the session exists and when it expires (None while its client is
        connected). Its packet ids change only through ``change_qos2``."""
        s = kg_mqtt_sessions
        row = {"client_id": client_id, "qos2_waiting": "", "expires_at": expires_at}
        await self.write(
            lambda conn: conn.execute(upsert(conn, s, ("client_id",), ("expires_at",)), [row])
        )

    async def mqtt_released(self, client_id: str, packet_ids: frozenset[int]) -> None:
        """PUBREL: the session no longer waits for these QoS 2 packet ids."""
        await self.write(lambda conn: self.change_qos2(conn, client_id, remove=packet_ids))

    def change_qos2(
        self,
        conn: sa.Connection,
        client_id: str,
        *,
        add: Iterable[int] = (),
        remove: Iterable[int] = (),
    ) -> None:
        """Add and remove packet ids of a session in ``conn``'s transaction: changes, never
        a whole set written over another (a publish's add and a PUBREL's removal commit in
        either order and both hold). The row is locked while it changes (PostgreSQL)."""
        s = kg_mqtt_sessions
        query = sa.select(s.c.qos2_waiting).where(s.c.client_id == client_id).with_for_update()
        text = conn.execute(query).scalar_one_or_none()
        if text is None:
            ids = set(add)
            if ids:
                row = {"client_id": client_id, "qos2_waiting": _encode_ids(frozenset(ids))}
                conn.execute(sa.insert(s).values(expires_at=None, **row))
            return
        ids = (_decode_ids(text) | set(add)) - set(remove)
        stmt = sa.update(s).where(s.c.client_id == client_id)
        conn.execute(stmt.values(qos2_waiting=_encode_ids(frozenset(ids))))

    async def drop_mqtt_session(self, client_id: str) -> None:
        s = kg_mqtt_sessions
        await self.write(lambda conn: conn.execute(sa.delete(s).where(s.c.client_id == client_id)))

    async def orphan_mqtt_sessions(self, *, expires_at: float) -> int:
        """At a gateway's start: sessions still marked connected (no expiry) belonged to
        connections of an earlier run that crashed or lost its lease, so they never got
        their expiry at disconnect. They expire at ``expires_at`` unless their client
        comes back first; returns how many."""
        s = kg_mqtt_sessions
        stmt = sa.update(s).where(s.c.expires_at.is_(None)).values(expires_at=expires_at)
        result = await self.write(lambda conn: conn.execute(stmt))
        return int(result.rowcount)

    async def expire_mqtt_sessions(self, *, now: float) -> int:
        """Delete the sessions that expired; returns how many."""
        s = kg_mqtt_sessions
        async with self.transaction() as conn:
            result = await conn.execute(sa.delete(s).where(s.c.expires_at <= now))
        return int(result.rowcount)
