"""Cluster example: per-key totals of every micro-batch, written with ``foreachBatch``.

    spark-submit --master spark://spark-master:7077 \\
        "$(python -c 'import spark.examples.foreach_batch_job as m; print(m.__file__)')" \\
        --url postgresql://keygate:secret@db:5432/keygate --follow
    .venv/bin/python -m spark.examples.foreach_batch_job [--url ...] [--queue demo-orders]
        [--group totals] [--out keygate-totals] [--follow]

The master comes from ``spark-submit`` (``local[2]`` when run with plain Python). Each
micro-batch reads one Spark partition per queue partition (split further with
``minPartitions`` for a large backlog) on the executors, sums the ``amount`` property per
key, and writes the batch's totals to ``<out>/totals/batch=<id>`` (overwritten when a
batch is replayed, so the sink is idempotent per batch). keygate commits the group's
progress in SQL when Spark commits the batch, and releases the group's lease when the
query stops. With an empty queue it first seeds 1,000 demo messages.
"""

from __future__ import annotations

import os
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import spark
from spark.examples.demo import arguments, message_count, seed, use_this_python


def main() -> None:
    parser = arguments(__doc__, group="totals")
    parser.add_argument("--out", type=Path, default=Path("keygate-totals"))
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--min-partitions", default="1")
    args = parser.parse_args()
    if message_count(args.url, args.queue) == 0:
        seed(args.url, args.queue, 1_000)
    use_this_python()
    builder = SparkSession.builder.appName("keygate-foreach-batch-example")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # plain Python, not under spark-submit
        builder = builder.master("local[2]")
    session = builder.getOrCreate()
    spark.register(session)  # the format, and the listener that frees the lease on stop
    out = args.out.resolve()

    def write_totals(batch: DataFrame, batch_id: int) -> None:
        totals = batch.groupBy("key").agg(
            F.sum(F.col("properties")["amount"].cast("long")).alias("amount"),
            F.count("*").alias("messages"),
        )
        totals.write.mode("overwrite").parquet(str(out / "totals" / f"batch={batch_id}"))

    stream = (
        session.readStream.format("keygate")
        .option("url", args.url)
        .option("queue", args.queue)
        .option("group", args.group)
        .option("minPartitions", args.min_partitions)
        .option("maxOffsetsPerTrigger", "10000")
        .load()
    )
    writer = stream.writeStream.foreachBatch(write_totals).option(
        "checkpointLocation", str(out / "checkpoint")
    )
    query = (
        writer.trigger(processingTime="5 seconds")
        if args.follow
        else writer.trigger(availableNow=True)
    ).start()
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    finally:
        session.stop()


if __name__ == "__main__":
    main()
