"""The Spark side of the group lease (DESIGN.md §7; storage/leases.py is the store's side,
and both run the statements of storage/statements.py).

A group is consumed by native flows or by one Spark job, never both. A Spark job that
commits (a streaming query, ``consume_batch``) holds ``kg_groups.lease_kind = 'spark'``,
``lease_owner = <job id>`` and ``lease_expires`` (renewed while it runs, cleared when it
stops). It refuses a group that native consumers hold: a ``kg_flows`` row in state
``running`` for the group, or an unexpired ``lease_kind = 'native'``. A plain batch read
commits nothing, takes no lease and only checks for native holders.

The update is conditional (free, expired, or already ours: ``storage.statements.lease_free``,
the gateway's definition too), so two jobs racing for the group cannot both win: the
loser's UPDATE matches no row.

Taking a lease and keeping it are different: a job that has taken the lease renews it
with ``keep``, which proves the lease is still the one it took instead of taking a free
one again. The owner id is that proof: every job's id is new (``new_owner``), and whoever
takes the lease in between writes its own id there, which stays until it releases the
lease (the row then names nobody). So a row that still names this job was never held by
anyone else, even if it expired meanwhile; any other row means the group was lost and may
have been consumed by another holder (``LeaseLost``).
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Final

import sqlalchemy as sa

from core.errors import GroupLeased, LeaseLost
from core.model import FlowState
from storage.schema import kg_flows, kg_groups
from storage.statements import group_is, lease_holder, release_lease, take_lease

# Waiting for a lease to lapse: allow for clock skew between the two jobs' machines.
_EXPIRY_MARGIN: Final = 0.5
SPARK: Final = "spark"
NATIVE: Final = "native"


def new_owner(role: str) -> str:
    """A job id that says where it runs: ``<role>@<host>:<pid-ish uuid>``."""
    return f"{role}@{socket.gethostname()}/{uuid.uuid4().hex[:12]}"


def _running_flows(conn: sa.Connection, queue: str, group: str) -> int:
    f = kg_flows
    return int(
        conn.execute(
            sa.select(sa.func.count()).where(
                f.c.queue == queue, f.c.group_name == group, f.c.state == FlowState.RUNNING.value
            )
        ).scalar_one()
    )


def refuse_native_holders(conn: sa.Connection, queue: str, group: str, now: float) -> None:
    """GroupLeased when native flows are bound to the group or hold its lease."""
    running = _running_flows(conn, queue, group)
    if running:
        raise GroupLeased(
            f"group {group!r} of {queue!r} has {running} running native flow(s); "
            "a Spark job cannot consume it until they unbind"
        )
    holder = conn.execute(lease_holder(queue, group)).first()
    if (
        holder is not None
        and holder.lease_kind == NATIVE
        and (holder.lease_expires is None or holder.lease_expires > now)
    ):
        raise GroupLeased(
            f"group {group!r} of {queue!r} is leased to native consumers "
            f"({holder.lease_owner!r}); a Spark job cannot consume it"
        )


def acquire(
    conn: sa.Connection, queue: str, group: str, owner: str, ttl: float, now: float
) -> None:
    """Take or renew the group's Spark lease for ``owner``; GroupLeased if anyone else holds
    it. The group must exist (see spark.db.ensure_group)."""
    refuse_native_holders(conn, queue, group, now)
    taken = conn.execute(take_lease(queue, group, SPARK, owner, ttl=ttl, now=now))
    if taken.rowcount == 1:
        return
    holder = conn.execute(lease_holder(queue, group)).one()
    raise GroupLeased(
        f"group {group!r} of {queue!r} is held by {holder.lease_kind} consumer "
        f"{holder.lease_owner!r} until {holder.lease_expires}; stop that job or wait "
        "for its lease to expire"
    )


def keep(conn: sa.Connection, queue: str, group: str, owner: str, ttl: float, now: float) -> None:
    """Renew the lease ``owner`` took (``acquire``) if it never lost it; LeaseLost when the
    row names another holder or nobody, or native flows are bound to the group. Called
    first in the transaction that settles or commits, which LeaseLost then rolls back."""
    g = kg_groups
    kept = conn.execute(
        sa.update(g)
        .where(group_is(queue, group), g.c.lease_kind == SPARK, g.c.lease_owner == owner)
        .values(lease_expires=now + ttl)
    )
    running = _running_flows(conn, queue, group)
    if kept.rowcount == 1 and not running:
        return
    holder = conn.execute(lease_holder(queue, group)).first()
    if holder is None:
        now_held = "the group was deleted"
    elif holder.lease_owner is not None and holder.lease_owner != owner:
        now_held = f"it is held by {holder.lease_kind} consumer {holder.lease_owner!r}"
    elif running:
        now_held = f"{running} native flow(s) are bound to the group"
    else:
        now_held = "another holder took it and released it"
    raise LeaseLost(
        f"{owner} lost its lease of group {group!r} of {queue!r} ({now_held}): it ran "
        f"longer than its lease timeout ({ttl:g} s), so other consumers may have consumed "
        "the group meanwhile; nothing was settled or committed"
    )


def acquire_waiting(engine: sa.Engine, queue: str, group: str, owner: str, ttl: float) -> None:
    """``acquire``, but wait (at most ``ttl``) for another Spark job's lease to lapse.

    PySpark gives a streaming source no reliable stop hook (the reader's ``stop`` is not
    called when a query ends), so a restarted query finds its predecessor's lease still
    set: it takes the group once that lease stops being renewed. A holder that keeps
    renewing, or native consumers, still make it fail with GroupLeased.
    """
    deadline = time.monotonic() + ttl
    while True:
        now = time.time()
        try:
            with engine.begin() as conn:
                acquire(conn, queue, group, owner, ttl, now)
            return
        except GroupLeased:
            with engine.connect() as conn:
                holder = conn.execute(lease_holder(queue, group)).first()
            if holder is None or holder.lease_kind != SPARK or holder.lease_expires is None:
                raise
            wait = holder.lease_expires - now + _EXPIRY_MARGIN
            if time.monotonic() + wait > deadline + _EXPIRY_MARGIN:
                raise
        time.sleep(max(0.0, min(wait, ttl / 4)))


def release(conn: sa.Connection, queue: str, group: str, owner: str) -> None:
    """Give the group up if ``owner`` still holds it (a no-op otherwise)."""
    conn.execute(release_lease(queue, group, owner))


__all__ = [
    "NATIVE",
    "SPARK",
    "acquire",
    "acquire_waiting",
    "keep",
    "new_owner",
    "refuse_native_holders",
    "release",
]
