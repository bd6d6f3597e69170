"""Alembic migrations build exactly the schema in storage.schema (SQLite and PostgreSQL),
and bring rows stored by older versions up to date."""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from core.model import Message, QueueConfig
from storage import migrate, migrate_sync, open_store, sync_engine
from storage.codec import message_row, queue_row
from storage.migrate import alembic_config
from storage.schema import kg_messages, kg_queues, metadata
from storage.views import VIEWS


def test_migrating_an_empty_database_gives_exactly_the_metadata(db_url: str) -> None:
    migrate_sync(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
            views = set(sa.inspect(conn).get_view_names())
            assert views == {name for name, _ in VIEWS}
            for name, _ in VIEWS:
                conn.execute(sa.select(sa.text("*")).select_from(sa.table(name)))
    finally:
        engine.dispose()


async def test_migrating_twice_is_harmless(db_url: str) -> None:
    await migrate(db_url)
    await migrate(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.connect() as conn:
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            assert MigrationContext.configure(conn).get_current_revision() == head
    finally:
        engine.dispose()


def test_downgrade_to_base_removes_every_table_and_view(db_url: str) -> None:
    migrate_sync(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            assert [t for t in inspector.get_table_names() if t.startswith("kg_")] == []
            assert inspector.get_view_names() == []
    finally:
        engine.dispose()


def _stored_before_0004(index: int) -> Message:
    """Messages of every shape: properties of each type (bytes, non-ASCII text, a float
    stored as text), each header, none of them."""
    shapes: list[dict[str, Any]] = [
        {"properties": {"s": "x", "n": 7, "f": 1.5, "b": True, "raw": b"\x00\x01\x02"}},
        {"properties": {"é": "ünïcode", "inf": float("inf")}, "key": "k-é"},
        {"key": "k", "topic": "t/1", "dedup_id": "d", "content_type": "text/plain"},
        {"correlation_id": "c", "reply_to": "r", "producer": "not-counted"},
        {},
    ]
    return Message(
        message_id=f"m{index}",
        queue="old",
        partition=index % 3,
        seq=index // 3 + 1,
        payload=b"p" * (index % 7),
        publish_time=1_700_000_000.0,
        **{"key": None, **shapes[index % len(shapes)]},
    )


def test_sizes_stored_before_0004_count_properties_and_headers_after_the_upgrade(
    db_url: str,
) -> None:
    # Before 0004 a message's size was its payload's length; since, it also counts
    # properties and headers (core.model.Message.size). More rows than one batch.
    migrate_sync(db_url, "0005")
    messages = [_stored_before_0004(i) for i in range(2_503)]
    old_rows = [{**message_row(m), "size": len(m.payload)} for m in messages]
    # A row stored by a later version already counts everything.
    current = _stored_before_0004(0)
    current = Message(**{**_fields(current), "queue": "new"})
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            messages_table = sa.Table("kg_messages", sa.MetaData(), autoload_with=conn)
            conn.execute(sa.insert(messages_table), [*old_rows, message_row(current)])
        migrate_sync(db_url)
        with engine.connect() as conn:
            m = kg_messages
            rows = conn.execute(sa.select(m.c.queue, m.c.partition, m.c.seq, m.c.size)).all()
    finally:
        engine.dispose()
    sizes = {(row.queue, row.partition, row.seq): row.size for row in rows}
    expected = {(x.queue, x.partition, x.seq): x.size for x in [*messages, current]}
    assert sizes == expected
    assert expected[("old", 0, 1)] > len(messages[0].payload)


def _fields(message: Message) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message) if f.init}


async def test_settings_sqlite_stored_past_32_bits_are_clamped_so_the_queue_reads_back(
    sqlite_url: str,
) -> None:
    # SQLite stored any 64-bit value before the settings had ranges; QueueConfig now
    # refuses window 2**40, so such a queue could not be read back.
    migrate_sync(sqlite_url, "0018")
    engine = sync_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            row = {**queue_row(QueueConfig("big")), "created_at": 1_700_000_000.0}
            row.update(max_message_size=2**40, max_deliveries=2**63 - 1, window_size=2**40)
            conn.execute(sa.insert(kg_queues), [row, {**row, "name": "big.dlq"}])
    finally:
        engine.dispose()
    migrate_sync(sqlite_url)
    store = await open_store(sqlite_url)
    try:
        config = await store.get_queue("big")
    finally:
        await store.close()
    assert config is not None
    top = 2**31 - 1
    assert (config.max_message_size, config.max_deliveries, config.window) == (top, top, top)
