"""Queue settings past what an INTEGER column holds on PostgreSQL, clamped to it.

Integer queue settings have a range since this version (core.settings): a value an
INTEGER column cannot hold on PostgreSQL (32 bits) is refused there and on SQLite alike.
Before, SQLite stored any 64-bit value, and a queue stored so could not be read back
(QueueConfig refuses it). ``max_message_size``, ``max_deliveries`` and ``window_size``
above 2**31 - 1 become 2**31 - 1, which means the same: no message is that large, a
message is not delivered two billion times, and a consumer's window is clamped to
``max_window`` anyway. Only SQLite can hold such rows; on PostgreSQL this updates nothing.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 08:20:00
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_INT32_MAX: Final = 2**31 - 1
_COLUMNS: Final = ("max_message_size", "max_deliveries", "window_size")


def upgrade() -> None:
    queues = sa.table("kg_queues", *(sa.column(name, sa.BigInteger) for name in _COLUMNS))
    for name in _COLUMNS:
        column = queues.c[name]
        op.execute(sa.update(queues).where(column > _INT32_MAX).values({name: _INT32_MAX}))


def downgrade() -> None:
    pass  # the clamped values mean what the old ones did
