"""keygate's Spark bulk consumer: the ``keygate`` data source and ``consume_batch``.

    import spark
    spark.register(session)
    df = session.read.format("keygate").option("url", url).option("queue", "orders") \\
        .option("group", "analytics").load()

See docs/spark.md for options, offsets, leases and failure handling.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from spark import stopping
from spark.batch import BatchResult, consume_batch
from spark.reader import SCHEMA_DDL
from spark.source import KeygateDataSource


def register(session: SparkSession) -> None:
    """Make ``format("keygate")`` available in ``session`` and release a keygate stream's
    group lease as soon as its query stops (idempotent)."""
    session.dataSource.register(KeygateDataSource)
    stopping.listen(session)


__all__ = ["SCHEMA_DDL", "BatchResult", "KeygateDataSource", "consume_batch", "register"]
