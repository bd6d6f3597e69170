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

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from core.actions import SeqRanges
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
BATCH_ROWS: Final = 8192


def render_value(value: Any) -> str:
    """A stored (JSON) property value as the string Spark shows."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return str(value.get(B64_KEY, ""))
    return repr(value) if isinstance(value, float) else str(value)


def _skipped(skip: SeqRanges, seq: int) -> bool:
    index = bisect_right(skip, (seq, float("inf"))) - 1
    return index >= 0 and skip[index][1] >= seq


def _shown(r: ReadRange, row: sa.Row[Any]) -> bool:
    """Not acked individually, and passing the group's tag filter (as core.delivery
    compares: the property's text equals the tag's value)."""
    if r.skip and _skipped(r.skip, row.seq):
        return False
    if not r.tags:
        return True
    properties = decode_properties(row.properties)
    return all(
        name in properties and property_text(properties[name]) == value for name, value in r.tags
    )


def _query(r: ReadRange) -> sa.Select[Any]:
    m, d = kg_messages, kg_deliveries
    return (
        sa.select(
            m.c.seq,
            m.c.message_id,
            m.c.key,
            m.c.payload,
            m.c.properties if r.include_properties or r.tags else sa.null().label("properties"),
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


def property_map(values: Sequence[Mapping[str, Any] | None]) -> pa.Array:
    """The ``properties`` column built as Arrow's flat offsets/keys/items arrays (no
    per-row list of pairs for pyarrow to walk)."""
    offsets = [0]
    names: list[str] = []
    items: list[str] = []
    for raw in values:
        if raw:
            names.extend(raw)
            items.extend(v if type(v) is str else render_value(v) for v in raw.values())
        offsets.append(len(names))
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(names, pa.string()), pa.array(items, pa.string())
    )


def _batch(r: ReadRange, rows: list[sa.Row[Any]]) -> pa.RecordBatch:
    seqs, ids, keys, payloads, properties, topics, times, records = zip(*rows, strict=True)
    seq = pa.array(seqs, pa.int64())
    # Shown count = deliveries so far + 1; a seq at or below dispatched_seq with no record
    # was delivered once (a native consumer's unacked first delivery).
    seen = pc.cast(pc.less_equal(seq, r.dispatched), pa.int32())
    counts = pc.add(pc.coalesce(pa.array(records, pa.int32()), seen), 1)
    micros = pc.round(pc.multiply(pa.array(times, pa.float64()), 1_000_000))
    columns = [
        pa.array([r.queue] * len(rows), pa.string()),
        pa.array([r.partition] * len(rows), pa.int32()),
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
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def read_range(r: ReadRange) -> Iterator[pa.RecordBatch]:
    """Rows of ``r`` in seq order, minus the seqs the group already acked above its
    committed seq."""
    engine = read_engine(r.url)
    try:
        with engine.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=BATCH_ROWS).execute(
                _query(r)
            )
            for chunk in result.partitions():
                rows = [row for row in chunk if _shown(r, row)]
                if rows:
                    yield _batch(r, rows)
    finally:
        engine.dispose()


__all__ = ["ARROW_SCHEMA", "SCHEMA_DDL", "property_map", "read_range", "render_value"]
