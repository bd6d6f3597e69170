"""Alembic environment: runs on the connection ``storage.migrate`` hands over.

``storage.migrate.migrate(url)`` opens the connection (with keygate's SQLite pragmas and
PostgreSQL search_path) and passes it in ``config.attributes["connection"]``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from storage.schema import metadata


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


_connection = context.config.attributes.get("connection")
if not isinstance(_connection, sa.Connection):
    raise RuntimeError("run keygate migrations through storage.migrate(url)")
_run(_connection)
