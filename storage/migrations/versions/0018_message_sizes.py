"""Message sizes stored before 0004 recomputed: payload, properties and headers.

Since 0004 a message's ``kg_messages.size`` counts its payload, every property (name,
value and 4 bytes) and every header the publisher set (core.model.Message.size); rows
stored before kept the old rule, the payload's length, so ``max_depth_bytes`` and
``kg_queue_stats.bytes`` under-counted them (QA: 1,090 bytes against 5,390 for the same
messages).

How it works: a row whose size equals its payload's length is the only kind that can be
stale (since 0004 any property adds at least 4 bytes; a row with no property and only
empty headers comes out the same). Those rows are read in primary-key order, a batch at a
time and without their payloads, and the ones whose size changes are updated; memory
stays bounded by the batch on any table. The rule is written out here, not imported, so
that this migration does the same whenever it runs; a later change of the rule brings its
own migration. Properties that cannot be decoded (written by hand) are left as they are.
Cost: 12 s for 200,000 old messages on SQLite, 17 s on PostgreSQL (a loaded machine,
2026-11-28), in the one migration transaction at the new gateway's start; rows stored
since 0004 are read (not their payloads) but not written.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 05:00:00
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Final

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

BATCH: Final = 1000
# What a property adds besides its name and value (core.model.PROPERTY_OVERHEAD at 0004).
_PROPERTY_OVERHEAD: Final = 4
# A number or a boolean counts 8 bytes.
_SCALAR: Final = 8
_HEADERS: Final = ("key", "topic", "dedup_id", "content_type", "correlation_id", "reply_to")
_KEY: Final = ("queue", "partition", "seq")

_messages = sa.table(
    "kg_messages",
    *(sa.column(name) for name in (*_KEY, *_HEADERS, "payload", "size")),
    sa.column("properties", sa.JSON),
)


def _text(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _value(value: Any) -> int:
    """A stored property value's size: text in UTF-8, bytes (``{"$b64": ...}``) decoded,
    anything else (numbers, booleans, floats stored as ``{"$f": ...}``) 8."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict) and set(value) == {"$b64"} and isinstance(value["$b64"], str):
        try:
            return len(base64.b64decode(value["$b64"], validate=True))
        except binascii.Error:
            return _text(value["$b64"])
    return _SCALAR


def _size(row: sa.Row[Any]) -> int | None:
    """The row's size by the rule of 0004, or None when its properties cannot be read."""
    properties = row.properties
    if isinstance(properties, str):
        try:
            properties = json.loads(properties)
        except ValueError:
            return None
    if not isinstance(properties, dict):
        return None
    size = int(row.payload_size)
    for name, value in properties.items():
        size += _PROPERTY_OVERHEAD + _text(name) + _value(value)
    for header in _HEADERS:
        value = getattr(row, header)
        if value is not None:
            size += _text(value)
    return size


def upgrade() -> None:
    conn = op.get_bind()
    m = _messages
    key = [m.c[name] for name in _KEY]
    payload_size = sa.func.length(m.c.payload)
    query = (
        sa.select(*key, *(m.c[name] for name in _HEADERS), m.c.properties, m.c.size)
        .add_columns(payload_size.label("payload_size"))
        .where(m.c.size == payload_size)
        .order_by(*key)
        .limit(BATCH)
    )
    update = (
        sa.update(m)
        .where(*(column == sa.bindparam(f"b_{column.name}") for column in key))
        .values(size=sa.bindparam("b_size"))
    )
    after: tuple[Any, ...] | None = None
    while True:
        page = query if after is None else query.where(sa.tuple_(*key) > sa.tuple_(*after))
        rows = conn.execute(page).all()
        if not rows:
            return
        changed = []
        for row in rows:
            size = _size(row)
            if size is not None and size != row.size:
                where = {f"b_{name}": getattr(row, name) for name in _KEY}
                changed.append(where | {"b_size": size})
        if changed:
            conn.execute(update, changed)
        last = rows[-1]
        after = tuple(getattr(last, name) for name in _KEY)


def downgrade() -> None:
    # The recomputed sizes stay: an older version subtracts a row's stored size when it
    # deletes it, so its depth accounting stays consistent with whatever is stored.
    pass
