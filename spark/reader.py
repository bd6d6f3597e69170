"""Executor side: read one seq range of one partition straight from SQL as Arrow batches.

Each task opens its own connection (nothing but plain data crosses the pickle boundary)
and streams rows in seq order with a server-side cursor on PostgreSQL. Arrow batches
avoid Spark's per-row Python conversion, which dominates the cost of small rows.

Messages outside the group's tag filter are not shown (the group skips them, as native
delivery does; a commit past them settles them). Properties are a ``map<string,string>``:
strings as they are, integers and floats in their JSON spelling (``42``, ``1.5``),
booleans as ``true``/``false``, bytes as base64.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from core.partition import property_text
from spark.db import read_engine
from spark.plan import ReadRange
from storage.codec import B64_KEY, decode_properties
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
        return str(value.get(B64_KEY, ""))
    return repr(value) if isinstance(value, float) else str(value)


def _json_objects(texts: Sequence[str]) -> list[dict[str, Any]]:
    """Many JSON object texts decoded in one call (one parser run, not one per row).
    Integers stay in their JSON spelling, the text Spark shows and tags compare."""
    return _DECODER.decode("[" + ",".join(texts) + "]")  # type: ignore[no-any-return]


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


def _query(r: ReadRange, dialect: sa.Dialect) -> str:
    """The range's SQL with its (validated) values inlined, for the driver's own cursor.
    Properties come as JSON text, decoded per batch in one call."""
    m, d = kg_messages, kg_deliveries
    # SQLite stores JSON as text already; PostgreSQL's jsonb is cast to its text form.
    text = m.c.properties if dialect.name == "sqlite" else sa.cast(m.c.properties, sa.Text)
    query = (
        sa.select(
            m.c.seq,
            m.c.message_id,
            m.c.key,
            m.c.payload,
            text if r.include_properties or r.tags else sa.null(),
            m.c.topic,
            m.c.publish_time,
            d.c.delivery_count,
        )
        .select_from(m)
        .outerjoin(
            d,
            sa.and_(
                d.c.queue == m.c.queue,
                d.c.group_name == r.group,
                d.c.partition == m.c.partition,
                d.c.seq == m.c.seq,
            ),
        )
        .where(m.c.queue == r.queue, m.c.partition == r.partition, m.c.seq > r.lo, m.c.seq <= r.hi)
        .order_by(m.c.seq)
    )
    if r.live_at is not None:
        query = query.where(sa.or_(m.c.expire_at.is_(None), m.c.expire_at > r.live_at))
    return str(query.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))


def _batch(r: ReadRange, rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    seqs, ids, keys, payloads, texts, topics, times, records = zip(*rows, strict=True)
    seq = pa.array(seqs, pa.int64())
    properties = _json_objects(texts) if texts[0] is not None else []
    # Shown count = deliveries so far + 1; a seq at or below dispatched_seq with no record
    # was delivered once (a native consumer's unacked first delivery).
    seen = pc.cast(pc.less_equal(seq, r.dispatched), pa.int32())
    counts = pc.add(pc.coalesce(pa.array(records, pa.int32()), seen), 1)
    micros = pc.round(pc.multiply(pa.array(times, pa.float64()), 1_000_000))
    columns = [
        pa.repeat(pa.scalar(r.queue, pa.string()), len(rows)),
        pa.repeat(pa.scalar(r.partition, pa.int32()), len(rows)),
        seq,
        pa.array(ids, pa.string()),
        pa.array(keys, pa.string()),
        pa.array(payloads, pa.binary()),
        property_map(properties)
        if r.include_properties
        else pa.nulls(len(rows), pa.map_(pa.string(), pa.string())),
        pa.array(topics, pa.string()),
        pc.cast(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        pc.cast(counts, pa.int32()),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
    keep = _shown(r, seq, properties)
    return batch if keep is None else batch.filter(keep)


def _chunks(engine: sa.Engine, r: ReadRange) -> Iterator[list[tuple[Any, ...]]]:
    """Raw driver tuples, BATCH_ROWS at a time: a server-side cursor in binary format on
    PostgreSQL (bytea arrives as bytes, not hex), a plain cursor on SQLite (one statement,
    one read snapshot). SQLAlchemy's per-row result processing is skipped."""
    sql = _query(r, engine.dialect)
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        if engine.dialect.name == "postgresql":
            cursor = driver.cursor(name="keygate_read", binary=True)
        else:
            cursor = driver.cursor()
        try:
            cursor.execute(sql)
            while chunk := cursor.fetchmany(BATCH_ROWS):
                yield chunk
        finally:
            cursor.close()


def read_range(r: ReadRange) -> Iterator[pa.RecordBatch]:
    """Rows of ``r`` in seq order, minus the seqs the group already acked above its
    committed seq."""
    engine = read_engine(r.url)
    try:
        for chunk in _chunks(engine, r):
            batch = _batch(r, chunk)
            if batch.num_rows:
                yield batch
    finally:
        engine.dispose()


__all__ = ["ARROW_SCHEMA", "SCHEMA_DDL", "property_map", "read_range", "render_value"]
