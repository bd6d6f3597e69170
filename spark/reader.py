"""Executor side: read one seq range of one partition straight from SQL as Arrow batches.

Each task opens its own connection (nothing but plain data crosses the pickle boundary)
and streams rows in seq order: on SQLite through ADBC, which returns Arrow record batches
with no Python object per row; on PostgreSQL from a server-side cursor in binary format.
The group's delivery records of the range are read once, before the messages, and
matched by seq. Arrow batches avoid Spark's per-row Python conversion, which dominates
the cost of small rows.

Messages outside the group's tag filter are not shown (the group skips them, as native
delivery does; a commit past them settles them). Properties are a ``map<string,string>``:
strings as they are, integers and floats in their JSON spelling (``42``, ``1.5``),
booleans as ``true``/``false``, bytes as base64.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import adbc_driver_sqlite.dbapi as adbc_sqlite
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import make_url

from core.partition import property_text
from spark.db import read_engine
from spark.plan import ReadRange
from storage.codec import B64_KEY, FLOAT_KEY, decode_properties
from storage.engine import SQLITE_BUSY_TIMEOUT_MS, is_sqlite
from storage.schema import kg_deliveries, kg_messages

SCHEMA_DDL: Final = (
    "queue string, partition int, seq long, message_id string, key string, payload binary, "
    "properties map<string,string>, topic string, publish_time timestamp, delivery_count int"
)
ARROW_SCHEMA: Final = pa.schema(
    [
        ("queue", pa.string()),
        ("partition", pa.int32()),
        ("seq", pa.int64()),
        ("message_id", pa.string()),
        ("key", pa.string()),
        ("payload", pa.binary()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("topic", pa.string()),
        ("publish_time", pa.timestamp("us", tz="UTC")),
        ("delivery_count", pa.int32()),
    ]
)
BATCH_ROWS: Final = 10_000
_DECODER: Final = json.JSONDecoder(parse_int=str)


def render_value(value: Any) -> str:
    """A stored (JSON) property value as the string Spark shows."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return str(value.get(B64_KEY, value.get(FLOAT_KEY, "")))
    return repr(value) if isinstance(value, float) else str(value)


def property_map(values: Sequence[Mapping[str, Any] | None]) -> pa.Array:
    """The ``properties`` column built as Arrow's flat offsets/keys/items arrays (no
    per-row list of pairs for pyarrow to walk)."""
    maps = [raw or {} for raw in values]
    offsets = list(itertools.accumulate(map(len, maps), initial=0))
    names = list(itertools.chain.from_iterable(maps))
    items = [
        v if type(v) is str else render_value(v)
        for v in itertools.chain.from_iterable(raw.values() for raw in maps)
    ]
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(names, pa.string()), pa.array(items, pa.string())
    )


def _tag_match(tags: tuple[tuple[str, str], ...], raw: Mapping[str, Any]) -> bool:
    """As core.delivery compares: the property's text equals the tag's value."""
    properties = decode_properties(raw)
    return all(
        name in properties and property_text(properties[name]) == value for name, value in tags
    )


def _shown(r: ReadRange, seq: pa.Array, properties: Sequence[Mapping[str, Any]]) -> pa.Array | None:
    """Mask of the rows not acked individually (``r.skip``) and passing the group's tag
    filter; None when every row is shown."""
    keep: np.ndarray | None = None
    if r.skip:
        seqs = seq.to_numpy()
        lows = np.array([lo for lo, _ in r.skip], np.int64)
        highs = np.array([hi for _, hi in r.skip], np.int64)
        index = np.searchsorted(lows, seqs, side="right") - 1
        keep = ~((index >= 0) & (seqs <= highs[np.maximum(index, 0)]))
    if r.tags:
        tagged = np.fromiter((_tag_match(r.tags, p) for p in properties), bool, len(properties))
        keep = tagged if keep is None else keep & tagged
    return None if keep is None else pa.array(keep)


def _wants_properties(r: ReadRange) -> bool:
    return r.include_properties or bool(r.tags)


def _messages_sql(r: ReadRange, dialect: sa.Dialect) -> str:
    """The range's messages with its (validated) values inlined, for the driver's own
    cursor. Properties come as JSON text, decoded per batch in one call."""
    m = kg_messages
    columns: list[sa.ColumnElement[Any]] = [m.c.seq, m.c.message_id]
    if dialect.name == "sqlite":
        # ADBC types each column from its first batch: a batch of NULL keys would be typed
        # int64 and refuse the next batch's strings. Nullable texts come as '' plus a flag.
        columns += [sa.func.coalesce(m.c.key, "").label("key"), m.c.payload]
        columns += [sa.func.coalesce(m.c.topic, "").label("topic"), m.c.publish_time]
        columns += [m.c.key.is_(None).label("key_null"), m.c.topic.is_(None).label("topic_null")]
        text: sa.ColumnElement[Any] = m.c.properties
    else:
        columns += [m.c.key, m.c.payload, m.c.topic, m.c.publish_time]
        # PostgreSQL's jsonb is read as its text form.
        text = sa.cast(m.c.properties, sa.Text)
    if _wants_properties(r):
        columns.append(text.label("properties"))
    query = (
        sa.select(*columns)
        .where(m.c.queue == r.queue, m.c.partition == r.partition, m.c.seq > r.lo, m.c.seq <= r.hi)
        .order_by(m.c.seq)
    )
    if r.live_at is not None:
        query = query.where(sa.or_(m.c.expire_at.is_(None), m.c.expire_at > r.live_at))
    return str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


def _records_sql(r: ReadRange, dialect: sa.Dialect) -> str:
    """The group's delivery records in the range: few (unacked redeliveries), read once
    per range instead of joined to every message."""
    d = kg_deliveries
    query = (
        sa.select(d.c.seq, d.c.delivery_count)
        .where(
            d.c.queue == r.queue,
            d.c.group_name == r.group,
            d.c.partition == r.partition,
            d.c.seq > r.lo,
            d.c.seq <= r.hi,
        )
        .order_by(d.c.seq)
    )
    return str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


@dataclass(frozen=True, slots=True)
class _Records:
    """A range's delivery records as sorted seqs and their delivery counts."""

    seqs: np.ndarray
    counts: np.ndarray

    def shown_counts(self, r: ReadRange, seq: pa.Array) -> pa.Array:
        """Shown count = deliveries so far + 1; a seq at or below dispatched_seq with no
        record was delivered once (a native consumer's unacked first delivery)."""
        seqs = seq.to_numpy()
        counts = (seqs <= r.dispatched).astype(np.int32) + 1
        if len(self.seqs):
            index = np.minimum(np.searchsorted(self.seqs, seqs), len(self.seqs) - 1)
            found = self.seqs[index] == seqs
            counts = np.where(found, self.counts[index] + 1, counts)
        return pa.array(counts, pa.int32())


def _records(rows: Sequence[tuple[Any, Any]] | pa.Table) -> _Records:
    if isinstance(rows, pa.Table):
        seqs, counts = rows.column(0).to_numpy(), rows.column(1).to_numpy()
    else:
        seqs = np.array([row[0] for row in rows], np.int64)
        counts = np.array([row[1] for row in rows], np.int64)
    return _Records(seqs.astype(np.int64), counts.astype(np.int32))


def _json_objects(texts: pa.Array) -> list[dict[str, Any]]:
    """Many JSON object texts decoded in one call (joined in Arrow, one parser run, not
    one per row). Integers stay in their JSON spelling, the text Spark shows and tags
    compare."""
    offsets = pa.array([0, len(texts)], pa.int32())
    joined = pc.binary_join(pa.ListArray.from_arrays(offsets, texts), ",")[0].as_py()
    return _DECODER.decode("[" + joined + "]")  # type: ignore[no-any-return]


def _batch(r: ReadRange, raw: pa.RecordBatch, records: _Records) -> pa.RecordBatch:
    """The source's batch from the driver's columns (seq, message_id, key, payload, topic,
    publish_time and, when wanted, properties as JSON text)."""
    rows = raw.num_rows
    seq = raw.column("seq").cast(pa.int64())
    properties = _json_objects(raw.column("properties")) if _wants_properties(r) else []
    micros = pc.round(pc.multiply(raw.column("publish_time").cast(pa.float64()), 1_000_000))
    columns = [
        pa.repeat(pa.scalar(r.queue, pa.string()), rows),
        pa.repeat(pa.scalar(r.partition, pa.int32()), rows),
        seq,
        raw.column("message_id").cast(pa.string()),
        raw.column("key").cast(pa.string()),
        raw.column("payload").cast(pa.binary()),
        property_map(properties)
        if r.include_properties
        else pa.nulls(rows, pa.map_(pa.string(), pa.string())),
        raw.column("topic").cast(pa.string()),
        pc.cast(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        records.shown_counts(r, seq),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
    keep = _shown(r, seq, properties)
    return batch if keep is None else batch.filter(keep)


def _with_nulls(raw: pa.RecordBatch) -> pa.RecordBatch:
    """SQLite's key and topic with their NULLs back (see ``_messages_sql``)."""
    for name in ("key", "topic"):
        flag = raw.column(f"{name}_null")
        if pc.any(pc.not_equal(flag, 0)).as_py():
            column = raw.column(name).cast(pa.string())
            nulled = pc.if_else(pc.not_equal(flag, 0), pa.scalar(None, pa.string()), column)
            raw = raw.set_column(raw.schema.get_field_index(name), name, nulled)
    return raw


def _sqlite_chunks(r: ReadRange) -> Iterator[tuple[pa.RecordBatch, _Records]]:
    """Arrow record batches straight from SQLite through ADBC (no Python object per row),
    BATCH_ROWS at a time. One deferred transaction: a WAL read snapshot shared by the
    records and the messages, and no lock the gateway's writers wait on."""
    path = make_url(r.url).database
    assert path, "an in-memory SQLite database cannot be read from another process"
    dialect = sqlite.dialect()
    with adbc_sqlite.connect(path) as conn, conn.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS:d}")
        cursor.execute(_records_sql(r, dialect))
        records = _records(cursor.fetch_arrow_table())
        cursor.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(BATCH_ROWS)})
        cursor.execute(_messages_sql(r, dialect))
        for raw in cursor.fetch_record_batch():
            yield _with_nulls(raw), records


def _postgres_chunks(r: ReadRange) -> Iterator[tuple[pa.RecordBatch, _Records]]:
    """Driver tuples, BATCH_ROWS at a time, from a server-side cursor in binary format
    (bytea arrives as bytes, not hex), without SQLAlchemy's per-row result processing.
    Repeatable read: the records and the messages come from one snapshot."""
    engine = read_engine(r.url)
    try:
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            driver = conn.connection.driver_connection
            assert driver is not None
            with driver.cursor() as plain:
                plain.execute(_records_sql(r, engine.dialect))
                records = _records(plain.fetchall())
            names = _NAMES + (("properties",) if _wants_properties(r) else ())
            with driver.cursor(name="keygate_read", binary=True) as cursor:
                cursor.execute(_messages_sql(r, engine.dialect))
                while chunk := cursor.fetchmany(BATCH_ROWS):
                    arrays = [pa.array(column) for column in zip(*chunk, strict=True)]
                    yield pa.RecordBatch.from_arrays(arrays, names=list(names)), records
    finally:
        engine.dispose()


_NAMES: Final = ("seq", "message_id", "key", "payload", "topic", "publish_time")


def read_range(r: ReadRange) -> Iterator[pa.RecordBatch]:
    """Rows of ``r`` in seq order, minus the seqs the group already acked above its
    committed seq."""
    chunks = _sqlite_chunks(r) if is_sqlite(r.url) else _postgres_chunks(r)
    for raw, records in chunks:
        batch = _batch(r, raw, records)
        if batch.num_rows:
            yield batch


__all__ = ["ARROW_SCHEMA", "SCHEMA_DDL", "property_map", "read_range", "render_value"]
