"""Leases in SQL: which kind of consumer holds a group, which gateway is active.

A group is consumed either by native flows through the gateway or by a Spark job, never
both: ``kg_groups.lease_kind`` / ``lease_owner`` / ``lease_expires`` say who holds it, and
the other kind is refused (GroupLeased) until the lease expires or is released. Holders
renew by acquiring again before expiry.

``kg_gateway_lease`` elects the active gateway among several sharing one PostgreSQL: the
holder renews; a standby takes over once ``expires_at`` (the database's clock) has
passed, incrementing ``epoch``, the fencing token every write of the holder checks
(StoreBase.transaction).
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from core.errors import GroupLeased, GroupNotFound, InvalidArgument
from storage.base import StoreBase
from storage.fence import database_now
from storage.schema import kg_gateway_lease
from storage.statements import lease_holder, release_lease, take_lease

LEASE_KINDS: Final = frozenset({"native", "spark"})
# How long taking or renewing the gateway lease waits for row locks (PostgreSQL).
LEASE_LOCK_TIMEOUT_MS: Final = 1000


class LeaseOps(StoreBase):
    async def acquire_group_lease(
        self, queue: str, group: str, kind: str, owner: str, *, ttl: float, now: float
    ) -> None:
        """Take or renew the group for ``(kind, owner)``; GroupLeased if another holds it."""
        if kind not in LEASE_KINDS:
            raise InvalidArgument(f"lease kind must be one of {sorted(LEASE_KINDS)}")
        async with self.transaction() as conn:
            result = await conn.execute(take_lease(queue, group, kind, owner, ttl=ttl, now=now))
            if result.rowcount == 1:
                return
            holder = (await conn.execute(lease_holder(queue, group))).first()
        if holder is None:
            raise GroupNotFound(queue, group)
        raise GroupLeased(
            f"group {group!r} of {queue!r} is held by {holder.lease_kind} consumer "
            f"{holder.lease_owner!r}"
        )

    async def release_group_lease(self, queue: str, group: str, owner: str) -> None:
        """Give the group up, if ``owner`` holds it."""
        async with self.transaction() as conn:
            await conn.execute(release_lease(queue, group, owner))

    async def acquire_gateway_lease(
        self, name: str, holder: str, *, ttl: float, epoch: int | None = None
    ) -> int | None:
        """Take the lease ``name`` for ``holder`` if it is free, has lapsed or is already
        its own (``epoch`` None), or renew the one held with ``epoch``. Returns the epoch
        now held (a takeover increments it), or None when another gateway holds the lease.

        Expiry is computed from the database's clock, never this host's. On PostgreSQL the
        statements wait at most LEASE_LOCK_TIMEOUT for the holder's write transactions
        (which hold the row FOR SHARE), so a frozen holder cannot hang its successor.
        An urgent write on the writer thread (StoreBase.write): one hand-over, ahead of
        the writes waiting. Through the async engine each statement waited for the event
        loop, and on SQLite for the write lock behind the appends: under a publish flood
        a renewal took seconds and timed out.
        """
        lease = kg_gateway_lease

        def take(conn: sa.Connection) -> int | None:
            now = database_now(conn.dialect.name)
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{LEASE_LOCK_TIMEOUT_MS}ms'")
            mine = sa.and_(lease.c.name == name, lease.c.holder == holder)
            if epoch is not None:
                renewed = conn.execute(
                    sa.update(lease)
                    .where(mine, lease.c.epoch == epoch)
                    .values(expires_at=now + ttl)
                )
                return epoch if renewed.rowcount == 1 else None
            dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
            conn.execute(
                dialect.insert(lease)
                .values(name=name, holder=holder, expires_at=now + ttl, epoch=1)
                .on_conflict_do_nothing(index_elements=["name"])
            )
            conn.execute(
                sa.update(lease)
                .where(lease.c.name == name, lease.c.holder != holder, lease.c.expires_at <= now)
                .values(holder=holder, epoch=lease.c.epoch + 1, expires_at=now + ttl)
            )
            # Already ours (taken with the migration, storage.migrate): renewed from now, so
            # that its expiry and the holder's renewal clock start together.
            conn.execute(sa.update(lease).where(mine).values(expires_at=now + ttl))
            held: int | None = conn.execute(
                sa.select(lease.c.epoch).where(mine)
            ).scalar_one_or_none()
            return held

        return await self.write(take, urgent=True, fenced=False)

    async def release_gateway_lease(self, name: str, holder: str) -> None:
        """Let the lease lapse now, so a standby takes over at once. The row (and its epoch)
        stays: epochs only grow, so an old holder's token never becomes valid again."""
        lease = kg_gateway_lease
        release = (
            sa.update(lease)
            .where(lease.c.name == name, lease.c.holder == holder)
            .values(expires_at=0.0)
        )
        await self.write(lambda conn: conn.execute(release), urgent=True, fenced=False)
