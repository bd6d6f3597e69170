"""What a partition's pages cost SQLite to read, and its messages to write, in two table
layouts: kg_messages' own (rows in publish order, a unique index on the key) and one
clustered by the key (``WITHOUT ROWID``, rows of a partition together), at one partition
and at many, with 4 KiB and 16 KiB database pages. Not the store: plain sqlite3, one
writer connection and one reader, to see whether a layout would make the reads of many
partitions as cheap as those of one (docs/performance.md, *Twelfth session*).

    .venv/bin/python -m benchmarks.sqlite_layout [--messages 100000] [--partitions 256]

Each case builds a fresh database in WAL mode with ``synchronous=FULL``: ``--messages``
rows of 1 KiB payloads, each in a partition drawn at random (as keys hash), appended in
transactions of 500 as group commit writes them; then reads every partition in turn, a
page of 64 rows (a turn) per read transaction, the writer committing one small update
between reads as the gateway's offset flushes do (which empties the reader's page cache,
as every commit by another connection does). Printed per case: the writer's CPU seconds
per 100,000 rows appended, the reader's per 100,000 rows read, and the file's size.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Final

PAYLOAD: Final = os.urandom(1024)
BATCH: Final = 500
PAGE: Final = 64
_COLUMNS: Final = (
    "queue TEXT NOT NULL, partition INTEGER NOT NULL, seq INTEGER NOT NULL, "
    "message_id TEXT, key TEXT, payload BLOB, properties TEXT, publish_time REAL"
)
_INSERT: Final = (
    "INSERT INTO m (queue, partition, seq, message_id, key, payload, properties, "
    "publish_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_PAGE: Final = (
    "SELECT partition, seq, message_id, key, payload, properties, publish_time FROM m "
    "WHERE queue = 'q' AND partition = ? AND seq > ? ORDER BY seq LIMIT ?"
)


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def build(path: Path, *, clustered: bool, page_size: int, messages: int, partitions: int) -> float:
    """Create and fill the table; the writer's CPU seconds per 100,000 rows."""
    writer = _connect(path)
    writer.execute(f"PRAGMA page_size={page_size}")
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA synchronous=FULL")
    if clustered:
        writer.execute(
            f"CREATE TABLE m ({_COLUMNS}, PRIMARY KEY (queue, partition, seq)) WITHOUT ROWID"
        )
    else:
        writer.execute(f"CREATE TABLE m (id INTEGER PRIMARY KEY, {_COLUMNS})")
        writer.execute("CREATE UNIQUE INDEX m_key ON m (queue, partition, seq)")
    draw = random.Random(1)
    seqs = [0] * partitions
    started = time.process_time()
    for first in range(0, messages, BATCH):
        rows = []
        for i in range(first, min(messages, first + BATCH)):
            p = draw.randrange(partitions)
            seqs[p] += 1
            rows.append(("q", p, seqs[p], f"{i:032x}", f"k{i % 1000}", PAYLOAD, "{}", 1.0))
        writer.execute("BEGIN IMMEDIATE")
        writer.executemany(_INSERT, rows)
        writer.execute("COMMIT")
    spent = time.process_time() - started
    writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    writer.close()
    return spent * 100_000 / messages


def read(path: Path, partitions: int) -> tuple[float, int]:
    """Read every partition a page at a time, in turn, a writer's commit between reads;
    the reader's CPU seconds per 100,000 rows, and the rows read."""
    writer, reader = _connect(path), _connect(path)
    writer.execute("CREATE TABLE o (p INTEGER PRIMARY KEY, v INTEGER)")
    cursors = dict.fromkeys(range(partitions), 0)
    got = 0
    spent = 0.0
    while cursors:
        for p in list(cursors):
            writer.execute("INSERT OR REPLACE INTO o VALUES (?, ?)", (p, got))
            started = time.process_time()
            reader.execute("BEGIN")
            rows = reader.execute(_PAGE, (p, cursors[p], PAGE)).fetchall()
            reader.execute("COMMIT")
            spent += time.process_time() - started
            if not rows:
                del cursors[p]
                continue
            cursors[p] = rows[-1][1]
            got += len(rows)
    writer.close()
    reader.close()
    return spent * 100_000 / max(1, got), got


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=256)
    args = parser.parse_args()
    for clustered in (False, True):
        for page_size in (4096, 16384):
            for partitions in sorted({1, args.partitions}):
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "layout.db"
                    writes = build(
                        path,
                        clustered=clustered,
                        page_size=page_size,
                        messages=args.messages,
                        partitions=partitions,
                    )
                    reads, rows = read(path, partitions)
                    size = path.stat().st_size / 1e6
                    name = "clustered" if clustered else "rowid"
                    print(
                        f"{name:9s} pages {page_size // 1024:2d} KiB, {partitions:4d} partitions:"
                        f" append {writes:.2f} s / 100k, read {reads:.2f} s / 100k"
                        f" ({rows} rows), file {size:.0f} MB",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
