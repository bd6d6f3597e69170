"""Leases in SQL: which kind of consumer holds a group, which gateway is active.

A group is consumed either by native flows through the gateway or by a Spark job, never
both: ``kg_groups.lease_kind`` / ``lease_owner`` / ``lease_expires`` say who holds it, and
the other kind is refused (GroupLeased) until the lease expires or is released. Holders
renew by acquiring again before expiry.

``kg_gateway_lease`` elects the active gateway among several sharing one PostgreSQL: the
holder renews; a standby takes over once ``expires_at`` has passed.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

from core.errors import GroupLeased, GroupNotFound, InvalidArgument
from storage.base import StoreBase, upsert
from storage.schema import kg_gateway_lease, kg_groups

LEASE_KINDS: Final = frozenset({"native", "spark"})


class LeaseOps(StoreBase):
    async def acquire_group_lease(
        self, queue: str, group: str, kind: str, owner: str, *, ttl: float, now: float
    ) -> None:
        """Take or renew the group for ``(kind, owner)``; GroupLeased if another holds it."""
        if kind not in LEASE_KINDS:
            raise InvalidArgument(f"lease kind must be one of {sorted(LEASE_KINDS)}")
        g = kg_groups
        free = sa.or_(
            g.c.lease_kind.is_(None),
            g.c.lease_expires <= now,
            sa.and_(g.c.lease_kind == kind, g.c.lease_owner == owner),
        )
        this = sa.and_(g.c.queue == queue, g.c.group_name == group)
        async with self.transaction() as conn:
            result = await conn.execute(
                sa.update(g)
                .where(this, free)
                .values(lease_kind=kind, lease_owner=owner, lease_expires=now + ttl)
            )
            if result.rowcount == 1:
                return
            holder = (
                await conn.execute(sa.select(g.c.lease_kind, g.c.lease_owner).where(this))
            ).first()
        if holder is None:
            raise GroupNotFound(queue, group)
        raise GroupLeased(
            f"group {group!r} of {queue!r} is held by {holder.lease_kind} consumer "
            f"{holder.lease_owner!r}"
        )

    async def release_group_lease(self, queue: str, group: str, owner: str) -> None:
        """Give the group up, if ``owner`` holds it."""
        g = kg_groups
        async with self.transaction() as conn:
            await conn.execute(
                sa.update(g)
                .where(g.c.queue == queue, g.c.group_name == group, g.c.lease_owner == owner)
                .values(lease_kind=None, lease_owner=None, lease_expires=None)
            )

    async def acquire_gateway_lease(
        self, name: str, holder: str, *, ttl: float, now: float
    ) -> bool:
        """Become (or stay) the active gateway ``name``; False while another holds it."""
        lease = kg_gateway_lease
        async with self.transaction() as conn:
            free = sa.or_(lease.c.holder == holder, lease.c.expires_at <= now)
            take = upsert(conn, lease, ("name",), ("holder", "expires_at"), where=free)
            row = {"name": name, "holder": holder, "expires_at": now + ttl}
            await conn.execute(take, [row])
            current = await conn.execute(sa.select(lease.c.holder).where(lease.c.name == name))
            return bool(current.scalar_one() == holder)

    async def release_gateway_lease(self, name: str, holder: str) -> None:
        lease = kg_gateway_lease
        async with self.transaction() as conn:
            await conn.execute(
                sa.delete(lease).where(lease.c.name == name, lease.c.holder == holder)
            )
